"""The simulated worker's command-line flags: ``add_sim_arguments`` (shared by ``gateway
sim``, ``gateway-sim`` and whoever starts a worker in process) and the checks each value
passes; ``SimConfig.from_args`` (config.py) resolves them into the process's config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import grpc

from gateway_sim.behaviour import MAX_REPORTED_TOKENS, parse_status_code
from gateway_sim.config import split_listen
from gateway_sim.timing import PROFILES

RUNTIMES = ("sglang", "vllm")
ROLES = ("regular", "prefill", "decode", "encode")
# SubscribeKvEvents as served by smg-grpc-servicer 0.14.1's relays: the Python one
# (kv_relay.py: live only) or the Rust one of its engine_servicer (history, snapshots).
KV_RELAYS = ("python", "rust")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _listen(value: str) -> str:
    split_listen(value)
    return value


def _non_negative(value: str) -> int:
    try:
        parsed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return parsed


def _positive(value: str) -> int:
    parsed = _non_negative(value)
    if parsed == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return parsed


def _uint32(value: str) -> int:
    parsed = _non_negative(value)
    if parsed > MAX_REPORTED_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_REPORTED_TOKENS}, got {value!r}")
    return parsed


def _port(value: str) -> int:
    parsed = _non_negative(value)
    if parsed > 65535:
        raise argparse.ArgumentTypeError(f"expected a port (0-65535), got {value!r}")
    return parsed


def _millis(value: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {value!r}") from None
    if not parsed >= 0:
        raise argparse.ArgumentTypeError(f"expected non-negative milliseconds, got {value!r}")
    return parsed


def _micros(value: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected microseconds, got {value!r}") from None
    if not parsed >= 0:
        raise argparse.ArgumentTypeError(f"expected non-negative microseconds, got {value!r}")
    return parsed


def _speed(value: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0.01 <= parsed <= 100.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a speed within 0.01..100, got {value!r}")
    return parsed


def _bounded(most: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        parsed = _positive(value)
        if parsed > most:
            raise argparse.ArgumentTypeError(f"expected at most {most}, got {value!r}")
        return parsed

    return parse


def _status(value: str) -> grpc.StatusCode:
    try:
        return parse_status_code(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulated worker's flags to ``parser`` (shared by ``gateway sim`` and
    ``gateway-sim``)."""
    parser.add_argument(
        "--listen",
        type=_listen,
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free port (default: %(default)s)",
    )
    parser.add_argument("--runtime", choices=RUNTIMES, default="sglang", help="wire protocol")
    parser.add_argument("--model", default="sim-model", help="served model name")
    parser.add_argument("--model-path", default=None, help="model path (default: sim/<model>)")
    parser.add_argument(
        "--name", default=None, help="worker name for logs and headers (default: runtime@host:port)"
    )
    parser.add_argument(
        "--tokens",
        type=_non_negative,
        default=16,
        help="output tokens when the request sets no maximum: the model then stops by "
        "itself, its last token the EOS token, finish_reason stop (default: %(default)s)",
    )
    parser.add_argument(
        "--tokens-per-chunk",
        type=_positive,
        default=1,
        help="tokens per streamed chunk, as an engine batches steps for a lagging "
        "reader (default: %(default)s)",
    )
    parser.add_argument("--ttft-ms", type=_millis, default=0.0, help="time to first token")
    parser.add_argument("--token-ms", type=_millis, default=0.0, help="delay between tokens")
    parser.add_argument(
        "--fail-code",
        type=_status,
        default=None,
        metavar="CODE",
        help="fail Generate/Embed with this gRPC status (e.g. UNAVAILABLE)",
    )
    parser.add_argument(
        "--fail-after",
        type=_non_negative,
        default=0,
        metavar="K",
        help="fail after K response messages (0: before any, as Trailers-Only)",
    )
    parser.add_argument(
        "--exit-after",
        type=_non_negative,
        default=None,
        metavar="K",
        help="kill the process after K messages of a Generate stream",
    )
    parser.add_argument(
        "--stall", action="store_true", help="accept Generate/Embed and never answer"
    )
    parser.add_argument(
        "--headers-first",
        action="store_true",
        help="send Generate's response headers as soon as a call is taken, not with its "
        "first message as the real servicers do (for tests that wait on a running call)",
    )
    parser.add_argument(
        "--abort-completes",
        action="store_true",
        help="SGLang: end an aborted Generate stream with a Complete, finish_reason abort, "
        "as vLLM does; its real servicer sends nothing more and the stream stays open "
        "until its deadline (per request: x-sim-abort-completes)",
    )
    parser.add_argument(
        "--usage-completion-tokens",
        type=_uint32,
        default=None,
        metavar="N",
        help="report completion_tokens N on every chunk and Complete, whatever was "
        "generated (a worker whose usage lies; per request: x-sim-completion-tokens)",
    )
    parser.add_argument(
        "--not-serving", action="store_true", help="start with grpc.health NOT_SERVING"
    )
    parser.add_argument(
        "--no-grpc-health",
        dest="grpc_health",
        action="store_false",
        help="do not register grpc.health.v1",
    )
    parser.add_argument(
        "--dp-ranks", type=_positive, default=1, help="DP ranks reported by GetLoads"
    )
    parser.add_argument(
        "--max-running",
        type=_positive,
        default=None,
        metavar="N",
        help="the scheduler's running window it reports (vLLM's max_num_seqs, SGLang's "
        "max_running_requests; default: the engine's own default)",
    )
    parser.add_argument(
        "--health-delay-ms",
        type=_millis,
        default=0.0,
        help="answer each grpc.health Check only after this delay (a slow worker)",
    )
    parser.add_argument("--health-hang", action="store_true", help="never answer grpc.health Check")
    parser.add_argument(
        "--load-waiting", type=_non_negative, default=0, help="waiting requests GetLoads reports"
    )
    parser.add_argument(
        "--load-token-usage",
        type=float,
        default=0.0,
        help="KV token usage (0..1) GetLoads reports at least",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    parser.add_argument(
        "--max-loras",
        type=_non_negative,
        default=None,
        metavar="N",
        help="SGLang: hold at most N LoRA adapters (a load past it fails) and refuse a "
        "Generate naming an adapter not loaded (default: no adapter checks at all)",
    )
    parser.add_argument(
        "--lora-load-ms", type=_millis, default=0.0, help="SGLang: time a LoRA adapter load takes"
    )
    _add_model_arguments(parser)
    _add_cache_arguments(parser)
    _add_timing_arguments(parser)
    parser.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this certificate")
    parser.add_argument("--tls-key", metavar="FILE", help="... and this private key")
    parser.add_argument(
        "--tls-client-ca", metavar="FILE", help="require client certificates from this CA"
    )
    _add_role_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The served model's limits, which the engines check every request against."""
    group = parser.add_argument_group(
        "model (defaults: the tiny Llama the real-engine tests serve)"
    )
    group.add_argument(
        "--max-model-len",
        type=_positive,
        default=2048,
        help="context length: longer prompts are refused, output stops where the "
        "context ends (default: %(default)s)",
    )
    group.add_argument(
        "--vocab-size",
        type=_positive,
        default=512,
        help="token ids at or above this are refused (default: %(default)s)",
    )


def _add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix cache per DP rank and its KV events (SubscribeKvEvents)."""
    group = parser.add_argument_group("prefix cache and KV events")
    group.add_argument(
        "--block-size",
        type=_positive,
        default=128,
        help="tokens per KV block (page), as GetServerInfo reports it; only full prompt "
        "blocks are cached (default: %(default)s, vLLM's CPU backend)",
    )
    group.add_argument(
        "--kv-blocks",
        type=_positive,
        default=4096,
        help="prefix cache capacity in blocks, per DP rank (default: %(default)s)",
    )
    group.add_argument(
        "--prefill-us-per-token",
        type=_micros,
        default=0.0,
        metavar="US",
        help="prefill time per prompt token not served from the cache, added to the "
        "time to first token (default: %(default)s)",
    )
    group.add_argument(
        "--kv-relay",
        choices=KV_RELAYS,
        default="python",
        help="how SubscribeKvEvents relays the events, as smg-grpc-servicer 0.14.1 "
        "does: python (its Python relay, kv_relay.py): live only, batches numbered from "
        "0 as vLLM's publisher numbers them, a non-zero start refused OUT_OF_RANGE, a "
        "lost batch ends the stream DATA_LOSS; rust (the Rust relay of its "
        "engine_servicer): batches numbered from 1, a history to resume from, a "
        "snapshot for a start from 0, DATA_LOSS past the history (default: %(default)s)",
    )
    group.add_argument(
        "--kv-history",
        type=_positive,
        default=1024,
        help="rust relay: KV event batches kept per DP rank for subscribers that resume "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--kv-drop-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="lose each live KV event batch with probability P: subscribers see a gap "
        "(rust relay: kept in its history, as a relay that missed it would; python "
        "relay: the stream ends DATA_LOSS at the next batch) (default: %(default)s)",
    )
    group.add_argument(
        "--kv-heartbeat-ms",
        type=_millis,
        default=1000.0,
        help="send a load-only batch after this long without one; 0: never (python "
        "relay: per stream, once a batch went, sooner when the load moves; rust relay: "
        "per DP rank) (default: %(default)s)",
    )
    group.add_argument(
        "--kv-heartbeat-backoff-ms",
        type=_millis,
        default=5000.0,
        help="python relay: the heartbeat interval once two heartbeats in a row carried "
        "the same load (default: %(default)s)",
    )
    group.add_argument(
        "--kv-queue",
        type=_positive,
        default=1024,
        help="live batches a KV event subscriber may fall behind; past it the rust "
        "relay drops it with RESOURCE_EXHAUSTED, the python relay loses the batches "
        "(DATA_LOSS at the next one) (default: %(default)s)",
    )
    group.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="answer SubscribeKvEvents with UNIMPLEMENTED, as an engine without KV events",
    )


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The timing model from published figures, the batch limit and the speed."""
    group = parser.add_argument_group("timing model (docs/simulator.md#timing-model)")
    group.add_argument(
        "--timing",
        choices=sorted(PROFILES),
        default=None,
        metavar="NAME",
        help="time prefills and output tokens from a GPU and model's published figures "
        f"({', '.join(sorted(PROFILES))}): prefill = uncached prompt tokens / its "
        "prefill tokens/s, one prefill at a time; inter-token time = a + b x running "
        "calls; it replaces --token-ms and --prefill-us-per-token (--ttft-ms still adds)",
    )
    group.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        metavar="F",
        help="divide every duration this worker takes by F (0.5: half as fast) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-batch",
        type=_bounded(65536),
        default=None,
        metavar="N",
        help="run at most N calls at once per DP rank, the others wait FIFO (their "
        "time to first token includes the wait; GetLoads reports them waiting) "
        "(default: no limit; with --timing, the profile's)",
    )
    group.add_argument(
        "--max-queue",
        type=_bounded(1_000_000),
        default=1024,
        metavar="N",
        help="with a batch limit, calls that may wait per DP rank; past it a call is "
        "refused RESOURCE_EXHAUSTED (default: %(default)s)",
    )


def _add_role_arguments(parser: argparse.ArgumentParser) -> None:
    """PD/EPD roles: which leg this worker is, and where its side channels listen."""
    group = parser.add_argument_group("disaggregation (PD / EPD)")
    group.add_argument(
        "--role",
        choices=ROLES,
        default="regular",
        help="worker role; encode serves SglangEncoder whatever --runtime says "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--bootstrap-port",
        type=_port,
        default=0,
        help="sglang prefill: bootstrap rendezvous port; 0 picks a free one, announced "
        "as bootstrap=PORT on the READY line",
    )
    group.add_argument(
        "--bootstrap-timeout-ms",
        type=_millis,
        default=3000.0,
        help="sglang decode: how long to wait for the room (default: %(default)s)",
    )
    group.add_argument(
        "--embedding-port",
        type=_port,
        default=0,
        help="sglang prefill: port encoders push embeddings to; 0 picks a free one, "
        "announced as embedding=PORT",
    )
    group.add_argument(
        "--embedding-timeout-ms",
        type=_millis,
        default=3000.0,
        help="sglang prefill: how long a multimodal request waits for all its "
        "embedding parts (default: %(default)s)",
    )
    group.add_argument(
        "--kv-port",
        type=_port,
        default=0,
        help="vllm prefill: KV side-channel port; 0 picks a free one, announced as kv=PORT",
    )
    group.add_argument(
        "--kv-timeout-ms",
        type=_millis,
        default=3000.0,
        help="vllm decode: bound on fetching the KV (default: %(default)s)",
    )
    group.add_argument(
        "--omit-kv-params",
        action="store_true",
        help="vllm prefill: answer without kv_transfer_params_json (a broken connector)",
    )
