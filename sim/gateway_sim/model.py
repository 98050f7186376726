"""The simulated model: the served model's facts (vocabulary, special tokens,
architecture) and the deterministic output, logprobs and embedding a prompt gets.

Every simulated worker computes the same answer for the same prompt, and the tests
compute it too (``output_tokens``, ``input_logprobs_for``, ``embedding_for``) to check
what came through the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The served model's facts: those of the tiny Llama the real-engine tests serve
# (scripts/engines/make_model.py), its vocabulary and context from the flags.
DEFAULT_VOCAB_SIZE = 512
BOS_TOKEN_ID = 1
EOS_TOKEN_IDS = (2,)
PAD_TOKEN_ID = 3
MODEL_TYPE = "llama"
ARCHITECTURES = ("LlamaForCausalLM",)
EMBEDDING_DIM = 8


def output_tokens(
    input_ids: Sequence[int], count: int, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[int]:
    """Deterministic output, as a greedy model's: token k is (first_output(input_ids) + k)
    % vocab_size, so the output continued from any point (the prompt and the tokens so
    far sent again) is the same output."""
    base = first_output(input_ids)
    return [(base + k) % vocab_size for k in range(count)]


def first_output(input_ids: Sequence[int]) -> int:
    """The first output token: the prompt's first token plus its length. The output goes
    up by one a token, so a prompt that ends with the first j outputs gets output j next."""
    return (input_ids[0] + len(input_ids)) if len(input_ids) else 0


def tokens_from(first_token: int, count: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """The same output continued from its first token alone, as a PD decode must:
    it never computes the prompt, it only has what the prefill handed over."""
    return [(first_token + k) % vocab_size for k in range(count)]


def input_logprobs_for(input_ids: Sequence[int]) -> list[float | None]:
    """The prompt logprobs a simulated worker reports (`Dialect.logprobs`), the first
    one None as in both engines."""
    return [None] + [logprob_of(token, -k - 1) for k, token in enumerate(input_ids) if k]


def embedding_for(input_ids: Sequence[int]) -> list[float]:
    """Deterministic embedding; multiples of 1/1024 so they survive float32 exactly."""
    seed = sum(input_ids) + len(input_ids)
    return [((seed * (j + 1) * 2_654_435_761) % 1024) / 1024.0 for j in range(EMBEDDING_DIM)]


def logprob_of(token: int, position: int) -> float:
    """A deterministic log probability; multiples of 1/64 survive float32 exactly."""
    return -(((token + position) % 61) + 1) / 64.0


def fill_top(top: Any, token: int, value: float, size: int, vocab_size: int) -> None:
    """A position's first ``size`` top logprobs (either proto's TopLogProbs): the token
    itself, then the runners-up after it, each a little less likely."""
    others = [(token + j) % vocab_size for j in range(1, max(size - 1, 0) + 1)]
    top.token_ids.extend([token, *others][:size])
    top.values.extend([value - j / 64.0 for j in range(len(others) + 1)][:size])
