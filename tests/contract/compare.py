"""What of a worker's answers the contract compares: each transcript entry (runner.py) cut
down to its features, with what legitimately differs between a real worker and the
simulator normalised away:

- token id values (a random-weight model's, against the simulator's own): only counts;
- the split of tokens across stream chunks: per choice, the tokens of all its chunks
  together, the sum of the chunks' completion_tokens, whether each chunk counts its own
  tokens (a delta), and the Complete's fields;
- timestamps, request ids, uptimes, load figures, paths, machine ids: presence only, or
  nothing;
- a transport error's or a deadline's text (the client library's): its code only;
- how many messages an aborted call got before its end: the abort's timing;
- time: KV load-record cadence in units of the configured heartbeat, rounded.

Everything else must be the same: status codes, the status message of validation errors,
which fields are present, the Complete's usage and finish reason, where headers come, the
header and trailer keys (but the simulator's own `x-sim-*`), and how the KV event stream
behaves across a restart.

The features of every call and of the unary ones: compare_unary.py; of Generate:
compare_generate.py; of the KV event stream: compare_kv.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.contract.calls import DECODE, PAIR, PREFILL, Contract
from tests.contract.compare_generate import generate_features
from tests.contract.compare_kv import kv_features
from tests.contract.compare_unary import unary_features

# --------------------------------------------------------------------------- all


def features(contract: Contract, name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    if contract.kv is not None and name == contract.kv.name:
        return kv_features(entry, contract.kv)
    call = contract.call(name)
    if call is None:
        raise KeyError(f"{contract.engine}'s contract has no call {name!r}")
    if call.method == "Generate" and call.leg == PAIR:
        return {leg: generate_features(entry[leg], call) for leg in (PREFILL, DECODE)}
    if call.method == "Generate":
        return generate_features(entry, call)
    return unary_features(entry, call)


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where two feature trees differ, one line each: `path: expected X, got Y`."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        lines = []
        for key in sorted(set(expected) | set(actual), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in actual:
                lines.append(f"{where}: expected {expected[key]!r}, missing")
            elif key not in expected:
                lines.append(f"{where}: not expected, got {actual[key]!r}")
            else:
                lines.extend(differences(expected[key], actual[key], where))
        return lines
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []
