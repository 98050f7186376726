"""SMG in front (docs/where-it-sits.md#smg-in-front), with real processes: SMG (the
`smg` binary of PyPI's `smg`, 1.13) serves OpenAI HTTP and tokenizes, this gateway is its
one gRPC worker, and simulated workers are behind the gateway. A completion, a streamed
completion and a chat completion sent to SMG come back well formed, and the gateway's
request log shows each Generate, under SMG's request id.

SMG finds the engine protocol by calling each engine's HealthCheck without a model in
the metadata, so the gateway answers it only with one model on that protocol: with two,
SMG never registers the gateway (the last test pins this).

SMG is not a dependency: without it every test here skips. `make test-smg` installs it
in a venv of its own (.engines/smg-venv) and runs this file with GATEWAY_SMG set; a `smg`
on PATH is used otherwise. No network: the tokenizer is made here (the word-level one of
scripts/engines/make_model.py) and the simulated worker reports its directory as its
model and tokenizer path (GetModelInfo, which the gateway forwards to the worker): SMG
loads each model's tokenizer from the path its worker reports (`--model-path` is not
needed, and does not replace it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gateway_sim.client import free_port
from gateway_sim.launch import Child, worker_url
from scripts.engines.make_model import BOS_ID, EOS_ID, MAX_POSITIONS, SPECIALS, words
from tests.support.helpers import request_events
from tests.support.launch import ROOT, Launcher
from tests.support.waits import until

MODEL = "tiny"
WAIT_S = 60.0  # SMG's start, its worker registration and tokenizer load on a busy machine
HTTP_S = 30.0
SERVICES = {
    "sglang": "sglang.grpc.scheduler.SglangScheduler",
    "vllm": "vllm.grpc.engine.VllmEngine",
}
# A chat template as a model's tokenizer_config.json carries it: the messages' contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def smg_binary() -> str | None:
    """GATEWAY_SMG, else `make test-smg`'s venv, else `smg` on PATH."""
    named = os.environ.get("GATEWAY_SMG")
    if named:
        return named
    beside = ROOT / ".engines" / "smg-venv" / "bin" / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


@pytest.fixture
def smg() -> str:
    binary = smg_binary()
    if binary is None:
        pytest.skip("no smg binary: `make test-smg` installs SMG 1.13 and runs these tests")
    return binary


def write_tokenizer(directory: Path) -> Path:
    """A Hugging Face tokenizer directory, as scripts/engines/make_model.py saves it (a
    word level vocabulary, whitespace split, `<s>` first), plus a chat template."""
    directory.mkdir()
    vocab = {word: index for index, word in enumerate(words())}
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": vocab[word], "content": word, **special, "special": True} for word in SPECIALS
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 0}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    config = {
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID],
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def start_smg(binary: str, gateway: Child, log_path: Path) -> Child:
    """`smg launch` with the gateway as its one worker, on loopback ports of its own."""
    port = free_port()
    args = (
        binary, "launch",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-urls", f"grpc://{gateway.address}",
        "--log-level", "info",
    )  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    child = Child(process, port, args)
    child.log_path = log_path
    return child


def http(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """GET (no body) or POST JSON to SMG; the status and the body's text."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_S) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:  # not listening yet
        return 0, str(error)


async def ask(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    return await asyncio.to_thread(http, port, path, body)


def sse(text: str) -> list[dict[str, Any]]:
    """A streamed answer's events, `data: [DONE]` last."""
    data = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", text
    return [json.loads(event) for event in data[:-1]]


def tail(path: Path, lines: int = 30) -> str:
    """The end of SMG's log, without its colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))
    return "\n".join(text.splitlines()[-lines:])


async def first_completion(router: Child) -> dict[str, Any]:
    """SMG's answer to a completion once SMG serves the model: it registers its worker,
    then loads the model's tokenizer in the background (until then it refuses)."""
    body = {"model": MODEL, "prompt": "ba be bi", "max_tokens": 5}
    answers: list[tuple[int, str]] = []

    async def served() -> bool:
        assert router.process.poll() is None, f"SMG exited:\n{tail(router.log_path)}"
        answers.append(await ask(router.port, "/v1/completions", body))
        return answers[-1][0] == 200

    try:
        await until(served, WAIT_S, what="a completion through SMG", every_s=0.2)
    except AssertionError as error:
        raise AssertionError(
            f"{error}; last answer {answers[-1:]}\nSMG:\n{tail(router.log_path)}"
        ) from None
    return dict(json.loads(answers[-1][1]))


async def logged_generate(log_path: Path, request_id: str) -> dict[str, Any]:
    """The gateway's request line for the Generate of SMG's request `request_id` (it is
    logged once the call is over)."""

    def found() -> list[dict[str, Any]]:
        return [e for e in request_events(log_path, "Generate") if e["request_id"] == request_id]

    await until(lambda: bool(found()), what=f"the gateway's request line for {request_id}")
    (event,) = found()
    return event


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
async def test_openai_calls_to_smg_go_through_the_gateway(
    runtime: str,
    smg: str,
    sim: Launcher,
    gateway: Launcher,
    processes: list[Child],
    tmp_path: Path,
) -> None:
    tokenizer = write_tokenizer(tmp_path / "model")
    worker = sim("--runtime", runtime, "--model", MODEL, "--model-path", str(tokenizer))
    gw = gateway("--worker", worker_url(worker, model=MODEL, runtime=runtime))
    router = start_smg(smg, gw, tmp_path / "smg.log")
    processes.append(router)

    completion = await first_completion(router)
    assert completion["object"] == "text_completion"
    assert completion["model"] == MODEL
    (choice,) = completion["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5  # five words of the vocabulary
    assert completion["usage"]["completion_tokens"] == 5
    event = await logged_generate(gw.log_path, completion["id"])
    assert (event["service"], event["model"], event["code"]) == (SERVICES[runtime], MODEL, "OK")
    assert event["worker"] == worker.address
    assert event["completion_tokens"] == 5

    status, text = await ask(
        router.port,
        "/v1/completions",
        {"model": MODEL, "prompt": "ba be bi", "max_tokens": 3, "stream": True},
    )
    assert status == 200, text
    chunks = sse(text)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    event = await logged_generate(gw.log_path, chunks[0]["id"])
    assert (event["code"], event["completion_tokens"]) == ("OK", 3)

    status, text = await ask(
        router.port,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "ba be"}], "max_tokens": 4},
    )
    assert status == 200, text
    chat = json.loads(text)
    assert chat["object"] == "chat.completion"
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 4
    assert choice["finish_reason"] == "length"
    event = await logged_generate(gw.log_path, chat["id"])
    assert (event["code"], event["completion_tokens"]) == ("OK", 4)


async def test_smg_does_not_name_the_model_so_two_models_on_a_protocol_keep_it_out(
    smg: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """SMG's HealthCheck carries no model metadata: with two SGLang models behind the
    gateway it gets INVALID_ARGUMENT MODEL_REQUIRED and does not register the gateway."""
    tokenizer = write_tokenizer(tmp_path / "model")
    urls = [
        worker_url(sim("--model", name, "--model-path", str(tokenizer)), model=name)
        for name in (MODEL, "other")
    ]
    gw = gateway(*(arg for url in urls for arg in ("--worker", url)))
    router = start_smg(smg, gw, tmp_path / "smg.log")
    processes.append(router)

    def refused() -> bool:
        return any(
            e["service"] == SERVICES["sglang"]
            and e["code"] == "INVALID_ARGUMENT"
            and e["reason"] == "MODEL_REQUIRED"
            for e in request_events(gw.log_path, "HealthCheck")
        )

    await until(refused, WAIT_S, what="SMG's HealthCheck without a model")
    answers: list[tuple[int, str]] = []

    async def listed() -> bool:
        answers.append(await ask(router.port, "/workers"))
        return answers[-1][0] == 200

    await until(listed, WAIT_S, what="SMG's worker list")
    assert json.loads(answers[-1][1])["total"] == 0
    assert not request_events(gw.log_path, "Generate")
