"""The call pipeline: the named stages a Generate or Embed call passes, in order.

    open -> admit -> read -> decode -> resolve -> classify -> charge -> wait -> dispatch

`PIPELINE` lists them; `OPENING` (its first three) is what every other RPC kind passes
before its own handler. Each stage is one small function of the call and what the
serving process gives the stages (`StageEnv`, `proxy/env.py`); the tenant's two (classify,
charge) live in `proxy/tenant.py`, the others here. A stage that refuses ends the call there
(a verdict, Trailers-Only). What a stage takes that must go back (an admission slot, a
tenant's tokens, a reservation, the usage tally) it registers on the call's ending, so
the call gives everything back once, however it ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from google.protobuf.message import DecodeError

from gateway.config import DEFAULT_PRIORITY_HEADER
from gateway.core.address import peer_host
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import (
    Verdict,
    bad_metadata,
    bad_slo,
    caller_over_share,
    gateway_overloaded,
    out_of_vocabulary,
    over_limit,
)
from gateway.engines import RpcKind
from gateway.engines.base import SPLIT_MIN_BYTES
from gateway.engines.tokens import highest
from gateway.placement.placer import Placer
from gateway.placement.placing import Placing
from gateway.placement.policies import Hints
from gateway.placement.routes import unroutable
from gateway.proxy.admission import Refusal
from gateway.proxy.call import Call
from gateway.proxy.env import Stage, StageEnv
from gateway.proxy.intake import read_request
from gateway.proxy.job import Job
from gateway.proxy.metadata import read_request_meta
from gateway.proxy.status import abort_invalid
from gateway.proxy.tenant import charge, classify

REGULAR_ONLY = (Role.REGULAR,)
# Refused at the gateway: SGLang's scheduler crashes on an empty prompt (and the call's
# retry would take the next worker down too); vLLM refuses it itself.
EMPTY_PROMPT = "The prompt is empty: tokenized.input_ids holds no token id"


async def run(sequence: Sequence[Stage], env: StageEnv, call: Call) -> None:
    """The stages in order, the record naming the one running (a refusal says where)."""
    for stage in sequence:
        call.entered(stage.__name__)
        await stage(env, call)


def in_mode(
    table: Sequence[Stage],
    *,
    before: Mapping[Stage, Stage] | None = None,
    after: Mapping[Stage, Stage] | None = None,
    instead: Mapping[Stage, Stage] | None = None,
) -> tuple[Stage, ...]:
    """The table run another way (SMG's modes: the same stages, another execution
    stage): a mode's own stages `before` or `after` some of the table's, one `instead`
    of another. Naming a stage the table does not have is an error, so a table that
    changes cannot leave a mode behind unnoticed."""
    before, after, instead = before or {}, after or {}, instead or {}
    unknown = [s.__name__ for s in (*before, *after, *instead) if s not in table]
    if unknown:
        raise ValueError(f"not stages of the table: {', '.join(unknown)}")
    sequence: list[Stage] = []
    for stage in table:
        if stage in before:
            sequence.append(before[stage])
        sequence.append(instead.get(stage, stage))
        if stage in after:
            sequence.append(after[stage])
    return tuple(sequence)


async def open_call(env: StageEnv, call: Call) -> None:
    """Its metadata read once (the bearer token, the routing hints, what goes upstream);
    the caller authenticated (API keys on: a known key, or UNAUTHENTICATED) and named; a
    value no worker channel would accept refused (BAD_METADATA), before anything is read
    or placed."""
    config, context = env.config, call.context
    flow, slo = config.flow, config.slo
    meta = read_request_meta(
        context.invocation_metadata(),
        config.model_headers,
        config.routing_key_header,
        config.target_worker_header,
        env.private_keys,
        (flow.priority_header, flow.tenant_header) if flow else (DEFAULT_PRIORITY_HEADER, ""),
        config.affinity.header or "",
        (slo.ttft_header, slo.tpot_header),
    )
    peer = context.peer()
    call.came_from(peer)
    principal = await env.door.identities.identify(context, meta.bearer, call.spec.path)
    caller = principal if principal is not None else "peer:" + peer_host(peer)
    call.opened(meta, principal, caller)
    if meta.bad_key is not None:
        await call.refuse(bad_metadata(meta.bad_key))
    if meta.bad_slo is not None:
        await call.refuse(bad_slo(meta.bad_slo))


async def admit(env: StageEnv, call: Call) -> None:
    """A slot in the gateway's concurrency bound and the caller's share of it, from the
    stream's opening (streams that send nothing count). The engine HealthCheck is
    answered from memory: it stays cheap and open under load."""
    if call.spec.kind is RpcKind.HEALTH_CHECK:
        return
    admission, retry_after_ms = env.door.admission, env.config.retry_after_ms
    refusal = admission.enter(call.caller)
    if refusal is None:
        call.on_end(lambda: admission.leave(call.caller))
    elif refusal is Refusal.GATEWAY_FULL:  # this process's share (--processes)
        await call.refuse(gateway_overloaded(admission.limit, retry_after_ms))
    else:
        await call.refuse(caller_over_share(call.caller, admission.per_caller, retry_after_ms))


async def read(env: StageEnv, call: Call) -> None:
    """The request message, read through the gate (the call's deadline until it is read:
    the read timeout, from the stream's opening)."""
    call.request = await read_request(call.context, env.door.gate, call.caller)


async def decode(env: StageEnv, call: Call) -> None:
    """The few fields routing reads (a long prompt's ids decoded without the GIL, off the
    loop), bounded by the limits on choices and prompt length; else INVALID_ARGUMENT."""
    spec, request = call.spec, call.request
    if spec.kind is not RpcKind.GENERATE:
        try:
            parsed: Any = spec.request_type.FromString(request)
        except DecodeError:
            await abort_invalid(call.context, f"Request bytes are not a valid {spec.name} request")
        ids = parsed.tokenized.input_ids
        call.decoded(len(ids), highest_token=highest(ids))
        return
    adapter = env.adapter
    try:
        if len(request) < SPLIT_MIN_BYTES:
            info = adapter.generate_info(request)
        else:
            info = await env.routing.offload.run(adapter.generate_info, request)
    except DecodeError:
        await abort_invalid(call.context, "Request bytes are not a valid GenerateRequest")
    call.decoded(len(info.tokens), info)
    limits = env.config.limits
    if info.n > limits.max_choices:
        field_name, limit, key = "sampling_params.n", limits.max_choices, "limits.max_choices"
        await call.refuse(over_limit("", field_name, info.n, limit, key))
    if len(info.tokens) > limits.max_prompt_tokens:
        field_name, limit = "tokenized.input_ids", limits.max_prompt_tokens
        verdict = over_limit("", field_name, len(info.tokens), limit, "limits.max_prompt_tokens")
        await call.refuse(verdict)


async def resolve(env: StageEnv, call: Call) -> None:
    """The model the call is for (named, or the protocol's only one), else refused. An
    alias is resolved to one of its targets (`placement/routes.py`), and the call is then
    placed as a call for that target. An empty prompt, or a token id past the model's
    vocabulary, is refused here (INVALID_ARGUMENT), before any worker sees it."""
    named_model = call.meta.model
    if named_model is not None and env.routing.routes.route(named_model) is not None:
        await _resolve_alias(env, call, named_model)
    else:
        resolved = env.routing.placer.resolve(named_model, env.adapter.runtime)
        if isinstance(resolved, Verdict):
            call.resolved(named_model or "")
            await call.refuse(resolved)
        call.resolved(resolved)
    info = call.info
    if info is not None and len(info.tokens) == 0 and not info.text_prompt:
        await abort_invalid(call.context, EMPTY_PROMPT)
    if call.highest_token >= 0:
        bound = env.routing.placer.vocabulary(call.model, env.adapter.runtime)
        if bound is not None and call.highest_token >= bound[0]:
            await call.refuse(out_of_vocabulary(call.model, call.highest_token, *bound))


async def _resolve_alias(env: StageEnv, call: Call, alias: str) -> None:
    """A target with a servable worker, by weight (by the routing key, if any); none: the
    verdict of the heaviest target, naming the alias (an engine HealthCheck is answered
    for that target instead: not servable)."""
    routes, placer, runtime = env.routing.routes, env.routing.placer, env.adapter.runtime

    def servable(model: str) -> bool:
        return placer.servable(model, runtime)

    target = routes.choose(alias, servable, call.meta.hints.routing_key)
    if target is not None:
        call.resolved(alias, target)
        return
    fallback = routes.heaviest(alias)
    verdict = _why_not(placer, fallback, runtime)
    if verdict is None or call.spec.kind is RpcKind.HEALTH_CHECK:
        call.resolved(alias, fallback)  # placeable after all (load aside): placed there
        return
    call.resolved(alias)
    await call.refuse(unroutable(alias, routes.leaves(alias), verdict))


def _why_not(placer: Placer, model: str, runtime: Runtime) -> Verdict | None:
    """What a call for `model` is refused with now (as if named directly), if it is."""
    resolved = placer.resolve(model, runtime)
    if isinstance(resolved, Verdict):
        return resolved
    placed = placer.place(model, runtime, Hints())
    return placed if isinstance(placed, Verdict) else None


def disaggregated(call: Call) -> bool:
    """A Generate whose model needs more than one leg: placed and run as a PD/EPD pair."""
    return call.info is not None and call.legs != REGULAR_ONLY


def placement(env: StageEnv, call: Call) -> Placing:
    """How each attempt is placed: every leg the model needs (the receiver only, for a
    call that is not a disaggregated Generate), on its session's workers when it can."""
    info = call.info
    items = info.mm_items if info is not None else ()
    return Placing(
        env.routing.placer,
        call.model,
        env.adapter.runtime,
        call.hints,
        items,
        call.legs,
        receiver_only=not disaggregated(call),
        session=call.meta.session,
    )


async def wait(env: StageEnv, call: Call) -> None:
    """How its attempts are placed (a cache-aware prompt's blocks hashed first, off the
    loop for a long one); with flow control, placed and reserved now or once capacity
    frees (waiting in the model's queue), else refused (QUEUE_FULL, QUEUE_TIMEOUT, or the
    verdict of a model that cannot be placed at all). An n > 1 disaggregated call does
    not wait as one: each choice is placed on its own pair, at once."""
    info, placer = call.info, env.routing.placer
    call.legs = legs = placer.legs(call.model, bool(info.mm_items) if info is not None else False)
    prefix = call.hints.prefix
    if prefix is not None:
        await prefix.prepare(
            placer.block_sizes(call.model, env.adapter.runtime, legs), env.routing.offload
        )
    sessions, session = env.routing.sessions, call.meta.session
    if sessions is not None and session is not None:  # bound by another replica, maybe
        await sessions.fetch(session, call.model, legs)
    call.place = place = placement(env, call)
    rooms = env.routing.rooms
    choices_apart = disaggregated(call) and info is not None and info.n > 1
    if rooms is None or env.config.flow is None or choices_apart:
        return
    record, tenant = call.record, call.tenant
    started, started_ns = time.monotonic(), time.time_ns()
    try:
        got = await rooms.admit(call.model, tenant, call.klass, call.cost, len(call.request), place)
    finally:  # also when the client left, or its deadline passed, while it waited
        call.queued(time.monotonic() - started)
    trace = call.trace
    if isinstance(got, Verdict):
        if trace is not None:
            trace.placement(started_ns, got, queued_s=record.queued_s)
        await call.refuse(got)
    call.placed_ahead = got
    call.on_end(lambda: rooms.done(tenant))  # its tenant may run another
    call.on_end(got.release_unused)  # the run's own (a no-op), unless it never started
    if trace is not None:
        trace.placement(started_ns, got.decision, queued_s=record.queued_s)


async def dispatch(env: StageEnv, call: Call) -> None:
    """Run it: the regular attempt loop on the receiver, or the disaggregated legs (each
    choice of n > 1 on its own pair); Generate's usage tallied as it ends."""
    info, record, routing = call.info, call.record, env.routing
    choices = info.n if info is not None else 1
    sink = call.client(env.tally(call))
    job = Job(call, env.adapter, call.request, sink, record.request_id, choices=choices)
    assert call.place is not None
    if info is not None and disaggregated(call):
        job = replace(job, return_logprob=info.return_logprob)
        await routing.disagg.serve(job, info.n, call.place, call.placed_ahead)
    else:
        attempt = routing.dispatcher.attempt(call.spec.server_streaming)
        call.reply = await routing.dispatcher.serve(job, call.place, attempt, call.placed_ahead)


OPENING: tuple[Stage, ...] = (open_call, admit, read)  # every RPC kind's first stages
PIPELINE: tuple[Stage, ...] = (*OPENING, decode, resolve, classify, charge, wait, dispatch)
PLACED = PIPELINE[len(OPENING) :]  # Generate and Embed, once read
