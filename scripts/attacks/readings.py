"""What the scenarios read off their calls and off the gateway: a call's status code, the
codes of many calls tallied, and one sample of the gateway's /metrics."""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter

from grpc import aio
from prometheus_client.parser import text_string_to_metric_families

from gateway_sim.launch import Child


def code_of(error: aio.AioRpcError | None) -> str:
    return "OK" if error is None else str(error.code().name)


async def metric(gw: Child, name: str, **labels: str) -> float | None:
    """One sample of the gateway's /metrics (None: no such series, as before a fix)."""
    url = f"http://127.0.0.1:{gw.port_of('metrics')}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())

    for family in text_string_to_metric_families(await asyncio.to_thread(scrape)):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def shown(value: float | None) -> str:
    return "absent" if value is None else f"{value:,.0f}"


def tally(codes: Counter[str]) -> str:
    return ", ".join(f"{code} {n}" for code, n in codes.most_common()) or "none"
