"""The vLLM worker contract's calls (VllmEngine), as data (calls.py says what a call is):
its info RPCs, Generate streamed and unary with their sampling options, its validation
errors, aborts, and what a real worker answers to undecodable requests."""

from __future__ import annotations

from tests.contract.calls import (
    DETAILS,
    FIRST_WORD,
    HEADER_TIMING,
    LONG,
    MAX_MODEL_LEN,
    SLOW_FIRST_TOKEN,
    UNDECODABLE,
    VLLM_SERVICE,
    VOCAB_SIZE,
    Call,
    generate,
    info_calls,
    prompt,
)

VLLM_CALLS: tuple[Call, ...] = (
    *info_calls(VLLM_SERVICE),
    Call(
        "generate_stream",
        "Generate",
        generate("generate_stream", prompt(8, 1), stream=True, max_tokens=8),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_unary",
        "Generate",
        generate("generate_unary", prompt(8, 2), stream=False, max_tokens=8),
    ),
    Call(
        "generate_stream_n2",
        "Generate",
        generate(
            "generate_stream_n2", prompt(8, 3), stream=True, max_tokens=6, n=2, temperature=1.0
        ),
        note="sampled (temperature 1, seeded): vLLM refuses n > 1 under greedy sampling",
    ),
    Call(
        "generate_unary_n2",
        "Generate",
        generate(
            "generate_unary_n2", prompt(8, 4), stream=False, max_tokens=6, n=2, temperature=1.0
        ),
    ),
    Call(
        "generate_n2_greedy",
        "Generate",
        generate("generate_n2_greedy", prompt(8, 16), stream=True, max_tokens=6, n=2),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_n0",
        "Generate",
        generate("generate_n0", prompt(8, 5), stream=True, max_tokens=3, n=0),
        note="n is a plain proto3 field: 0 is the same as unset",
    ),
    Call(
        "generate_stop_token_ids",
        "Generate",
        # Every word is a stop token: the first generated one stops the call, whichever
        # it is (the simulator's ids are not the model's).
        generate(
            "generate_stop_token_ids",
            prompt(8, 6),
            stream=True,
            max_tokens=8,
            stop_token_ids=list(range(FIRST_WORD, VOCAB_SIZE)),
        ),
    ),
    Call(
        "generate_stop_token_ids_unary",
        "Generate",
        generate(
            "generate_stop_token_ids_unary",
            prompt(8, 7),
            stream=False,
            max_tokens=8,
            stop_token_ids=list(range(FIRST_WORD, VOCAB_SIZE)),
        ),
    ),
    Call(
        "generate_logprobs_stream",
        "Generate",
        generate(
            "generate_logprobs_stream",
            prompt(6, 8),
            stream=True,
            max_tokens=4,
            logprobs=2,
            prompt_logprobs=1,
        ),
    ),
    Call(
        "generate_logprobs_unary",
        "Generate",
        generate(
            "generate_logprobs_unary",
            prompt(6, 9),
            stream=False,
            max_tokens=4,
            logprobs=2,
            prompt_logprobs=1,
        ),
    ),
    Call(
        "generate_long_prompt",
        "Generate",
        generate("generate_long_prompt", prompt(LONG, 10), stream=True, max_tokens=2),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_long_prompt_cached",
        "Generate",
        generate("generate_long_prompt_cached", prompt(LONG, 10), stream=True, max_tokens=2),
        note="the same prompt again: its full blocks come from the prefix cache",
    ),
    Call(
        "generate_max_tokens_past_context",
        "Generate",
        generate(
            "generate_max_tokens_past_context",
            prompt(MAX_MODEL_LEN - 8, 11),
            stream=True,
            max_tokens=100,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_fills_context",
        "Generate",
        generate(
            "generate_prompt_fills_context", prompt(MAX_MODEL_LEN, 12), stream=True, max_tokens=1
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_over_context",
        "Generate",
        generate(
            "generate_prompt_over_context", prompt(MAX_MODEL_LEN + 1, 13), stream=True, max_tokens=1
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_empty_prompt",
        "Generate",
        generate("generate_empty_prompt", [], stream=True, max_tokens=4),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_out_of_vocabulary",
        "Generate",
        generate("generate_out_of_vocabulary", [5, VOCAB_SIZE + 88, 7], stream=True, max_tokens=4),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_max_tokens_zero",
        "Generate",
        generate("generate_max_tokens_zero", prompt(8, 14), stream=True, max_tokens=0),
        checks=frozenset({DETAILS}),
    ),
    UNDECODABLE,
    Call(
        "abort_running",
        "Generate",
        generate("abort_running", prompt(8, 15), stream=True, max_tokens=1000),
        metadata=(("x-sim-token-ms", "20"),),
        abort_after=2,
    ),
    Call("abort_unknown", "Abort", {"request_ids": ["no-such-request"]}),
)
