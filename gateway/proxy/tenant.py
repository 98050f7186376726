"""The tenant's stages: whose budget the call uses, its class, its cost, and the charge.

Its own module because these two stages (`classify`, `charge`) are flow control's and
rate limits' part of the pipeline (`proxy/stages.py` lists them): the tenant a call
counts for (its principal, or a trusted tenant header), its class lowered to the
tenant's `max_class`, its cost in tokens, taken from the tenant's budget and settled
from what it used as it ends.
"""

from __future__ import annotations

import math

from gateway.core.slo import Slo
from gateway.core.verdicts import rate_limited, shown
from gateway.flow.budget import Charge, OverBudget
from gateway.proxy.call import Call
from gateway.proxy.env import StageEnv
from gateway.state.budgets import TenantBudgets


async def classify(env: StageEnv, call: Call) -> None:
    """Whose budget and queue share the call uses (its principal: an API key's name, a
    client certificate's identity; the tenant header behind a trusted proxy; else
    `default`), its class with flow control (the one it asks for, lowered to its
    tenant's `max_class`), and its cost in tokens: the prompt, plus what its choices may
    generate. Tenant and class go into the record when flow control or rate limits are
    on; its latency objectives, if it states any, into its hints."""
    flow, record, info = env.config.flow, call.record, call.info
    cost = record.prompt_tokens
    if info is not None:
        cost += (info.max_new_tokens or env.estimate) * info.n
    asked_class, asked_tenant = call.meta.flow
    tenant = "default"
    if flow is not None and flow.trust_tenant_header and asked_tenant:
        tenant = shown(asked_tenant)
    elif record.principal is not None:  # `key:NAME` or `cert:NAME`: the tenant NAME
        tenant = record.principal.partition(":")[2]
    if flow is None:
        rates = env.door.rates
        call.classified(tenant, cost, shown=rates is not None and rates.active)
        named = asked_class or ""  # named only if sheddable: a client's names are not labels
        _objectives(env, call, named if named in env.config.slo.sheddable else "")
        return
    klass = flow.index(asked_class) if asked_class is not None else None
    if klass is None:
        klass = flow.index(flow.default_class)
    assert klass is not None
    cap = env.config.tenant(tenant).max_class
    ceiling = flow.index(cap) if cap is not None else None
    lowered = False
    if ceiling is not None and klass < ceiling:
        klass, lowered = ceiling, True
    priority = flow.classes[klass].name
    call.classified(tenant, cost, klass, shown=True, priority=priority, lowered=lowered)
    _objectives(env, call, priority)


def _objectives(env: StageEnv, call: Call, klass: str) -> None:
    """The latency objectives its headers state, if any: sheddable when its class is
    one of `slo.sheddable` (flow control's class; without it, the class it asked for)."""
    ttft_s, tpot_s = call.meta.slo
    if ttft_s is not None or tpot_s is not None:
        call.aimed(Slo(ttft_s, tpot_s, klass in env.config.slo.sheddable), klass)


async def charge(env: StageEnv, call: Call) -> None:
    """Taken from the tenant's rate limits (its tokens reserved; in the shared store, with
    `state:`), else RATE_LIMITED with the time its budget allows the call; settled from
    what it used as it ends (all back if no worker saw it). Nothing without rate limits."""
    rates = env.door.rates
    if rates is None or not rates.active:
        return
    taken = await rates.take(call.tenant, call.cost)
    if isinstance(taken, OverBudget):
        wait_ms = math.ceil(taken.wait_s * 1000)
        verdict = rate_limited(call.model, call.tenant, taken.budget, taken.per_minute, wait_ms)
        await call.refuse(verdict)
    if taken is not None:  # the tenant has limits
        call.on_end(lambda: _settle(rates, taken, call))


def _settle(rates: TenantBudgets, charge: Charge, call: Call) -> None:
    record = call.record
    # What the client received, plus what migrations re-sent (each continuation's prompt);
    # a call the picker placed whose usage it could not read: what it may have used.
    used: int | None = None
    if record.picked and record.attempts and record.completion_tokens is None:
        used = call.cost
    elif record.attempts:
        used = record.prompt_tokens + (record.completion_tokens or 0) + record.resent_tokens
    rates.settle(charge, used)
