"""The SGLang worker contract's calls (SglangScheduler), as data (calls.py says what a call
is): SGLang's equivalents of the vLLM calls (calls_vllm.py), with its page size and
logprobs options."""

from __future__ import annotations

from tests.contract.calls import (
    DETAILS,
    FIRST_WORD,
    HEADER_TIMING,
    LONG,
    MAX_MODEL_LEN,
    SGLANG_SERVICE,
    SLOW_FIRST_TOKEN,
    UNDECODABLE,
    VOCAB_SIZE,
    Call,
    info_calls,
    prompt,
    sgl_generate,
)

SGLANG_PAGE_SIZE = 1  # its radix cache: a prefix is cached to the token
SGLANG_LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
ALL_WORDS_STOP = list(range(FIRST_WORD, VOCAB_SIZE))

# SGLang's equivalents of the vLLM calls. Left out: an empty prompt and an out-of-vocabulary
# id, each of which kills a real SGLang worker (docs/real-engines.md), and the KV events
# scenario (no SubscribeKvEvents without --kv-events-config: one plain call shows it).
SGLANG_CALLS: tuple[Call, ...] = (
    *info_calls(SGLANG_SERVICE),
    Call(
        "generate_stream",
        "Generate",
        sgl_generate("generate_stream", prompt(8, 1), stream=True, max_new_tokens=8),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_unary",
        "Generate",
        sgl_generate("generate_unary", prompt(8, 2), stream=False, max_new_tokens=8),
    ),
    Call(
        "generate_stream_n2",
        "Generate",
        sgl_generate("generate_stream_n2", prompt(8, 3), stream=True, max_new_tokens=6, n=2),
        note="greedy: SGLang takes n > 1 under greedy sampling (vLLM refuses it)",
    ),
    Call(
        "generate_unary_n2",
        "Generate",
        sgl_generate("generate_unary_n2", prompt(8, 4), stream=False, max_new_tokens=6, n=2),
    ),
    Call(
        "generate_n0",
        "Generate",
        sgl_generate("generate_n0", prompt(8, 5), stream=True, max_new_tokens=3, n=0),
        note="n is a plain proto3 field: 0 is the same as unset",
    ),
    Call(
        "generate_stop_token_ids",
        "Generate",
        sgl_generate(
            "generate_stop_token_ids",
            prompt(8, 6),
            stream=True,
            max_new_tokens=8,
            stop_token_ids=ALL_WORDS_STOP,
        ),
    ),
    Call(
        "generate_stop_token_ids_unary",
        "Generate",
        sgl_generate(
            "generate_stop_token_ids_unary",
            prompt(8, 7),
            stream=False,
            max_new_tokens=8,
            stop_token_ids=ALL_WORDS_STOP,
        ),
    ),
    Call(
        "generate_logprobs_stream",
        "Generate",
        sgl_generate(
            "generate_logprobs_stream", prompt(6, 8), True, SGLANG_LOGPROBS, max_new_tokens=4
        ),
    ),
    Call(
        "generate_logprobs_unary",
        "Generate",
        sgl_generate(
            "generate_logprobs_unary", prompt(6, 9), False, SGLANG_LOGPROBS, max_new_tokens=4
        ),
    ),
    Call(
        "generate_long_prompt",
        "Generate",
        sgl_generate("generate_long_prompt", prompt(LONG, 10), stream=True, max_new_tokens=2),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_long_prompt_cached",
        "Generate",
        sgl_generate(
            "generate_long_prompt_cached", prompt(LONG, 10), stream=True, max_new_tokens=2
        ),
        note="the same prompt again: all but its last token come from the radix cache",
    ),
    Call(
        "generate_max_tokens_past_context",
        "Generate",
        sgl_generate(
            "generate_max_tokens_past_context",
            prompt(MAX_MODEL_LEN - 8, 11),
            stream=True,
            max_new_tokens=100,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_fills_context",
        "Generate",
        sgl_generate(
            "generate_prompt_fills_context",
            prompt(MAX_MODEL_LEN, 12),
            stream=True,
            max_new_tokens=1,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_over_context",
        "Generate",
        sgl_generate(
            "generate_prompt_over_context",
            prompt(MAX_MODEL_LEN + 1, 13),
            stream=True,
            max_new_tokens=1,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_max_tokens_zero",
        "Generate",
        sgl_generate("generate_max_tokens_zero", prompt(8, 14), stream=True, max_new_tokens=0),
        checks=frozenset({DETAILS}),
    ),
    UNDECODABLE,
    Call(
        "abort_running",
        "Generate",
        sgl_generate("abort_running", prompt(8, 15), stream=True, max_new_tokens=1000),
        metadata=(("x-sim-token-ms", "20"),),
        abort_after=2,
        timeout_s=5.0,
        note="SGLang stops the request but its stream never ends: the deadline ends it",
    ),
    Call("abort_unknown", "Abort", {"request_id": "no-such-request"}),
    Call(
        "subscribe_kv_events",
        "SubscribeKvEvents",
        {"start_sequence_number": 0, "load_records_before_first_batch": True},
        checks=frozenset({DETAILS}),
        timeout_s=5.0,
    ),
)
