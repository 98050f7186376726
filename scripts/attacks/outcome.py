"""What one scenario measured (`Outcome`), the pass criteria it is judged by, and how its
figures are printed: a few lines as it ends, one line of the table after every run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The pass criteria (the issue's).
MIN_OK_FRACTION = 0.99
MAX_P99_RATIO = 2.0
MAX_STALL_MS = 100.0
MAX_RSS_GROWTH_MIB = 20.0


@dataclass(frozen=True, slots=True)
class Check:
    """One criterion, or a figure shown beside them (`passed` None: information)."""

    name: str
    shown: str
    passed: bool | None = None


@dataclass
class Outcome:
    """What one scenario measured."""

    name: str
    summary: str
    skipped: str | None = None
    legit: tuple[dict[str, Any], dict[str, Any]] = ({}, {})  # baseline, attack
    health: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    rss_mib: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # base, peak, after
    threads: tuple[int, int, int] = (0, 0, 0)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    def criteria(self) -> list[Check]:
        """The four common criteria, then the scenario's own."""
        if self.skipped:
            return []
        base, attack = self.legit
        ok = ok_fraction(attack)
        ratio = attack["p99_ms"] / base["p99_ms"] if base.get("p99_ms") else math.inf
        stall = self.health[1]["max_ms"]
        growth = self.rss_mib[2] - self.rss_mib[0]
        own = [c for c in self.checks if c.passed is not None]
        return [
            Check("legit >= 99% OK", f"{ok * 100:.1f}%", ok >= MIN_OK_FRACTION),
            Check("p99 <= 2x", f"x{ratio:.1f}", ratio <= MAX_P99_RATIO),
            Check("stall <= 100 ms", f"{stall:.0f} ms", stall <= MAX_STALL_MS),
            Check("RSS after <= +20 MiB", f"{growth:+.1f} MiB", growth <= MAX_RSS_GROWTH_MIB),
            *own,
        ]


def ok_fraction(stats: dict[str, Any]) -> float:
    calls = stats.get("calls", 0)
    return stats.get("ok", 0) / calls if calls else 0.0


def verdict(passed: bool | None) -> str:
    return "-" if passed is None else ("PASS" if passed else "FAIL")


def detail(outcome: Outcome) -> str:
    """A scenario's figures, a few lines, printed as soon as it ends."""
    head = f"== {outcome.name}: {outcome.summary}"
    if outcome.skipped:
        return f"{head}\n   SKIPPED: {outcome.skipped}"
    (lb, la), (hb, ha) = outcome.legit, outcome.health
    rss, threads = outcome.rss_mib, outcome.threads

    def legit(s: dict[str, Any]) -> str:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(s["codes"].items()))
        return (
            f"{s['calls']} calls {ok_fraction(s) * 100:.1f}% OK, p50 {s['p50_ms']:.1f} "
            f"p90 {s['p90_ms']:.1f} p99 {s['p99_ms']:.1f} ms ({codes})"
        )

    def health(s: dict[str, Any]) -> str:
        return (
            f"{s['checks']} checks, {s['failed']} failed, stall max {s['max_ms']:.0f} "
            f"p99 {s['p99_ms']:.0f} ms"
        )

    lines = [
        f"{head} ({outcome.seconds:.0f} s)",
        f"   legit    baseline: {legit(lb)}",
        f"            attack:   {legit(la)}",
        f"   health   baseline: {health(hb)}",
        f"            attack:   {health(ha)}",
        f"   gateway  RSS {rss[0]:.1f} / {rss[1]:.1f} / {rss[2]:.1f} MiB, threads "
        f"{threads[0]} / {threads[1]} / {threads[2]} (baseline / peak / after)",
    ]
    lines += [f"   {c.name}: {c.shown}" for c in outcome.checks if c.passed is None]
    lines.append(
        "   criteria "
        + "; ".join(f"{c.name} {c.shown} {verdict(c.passed)}" for c in outcome.criteria())
    )
    return "\n".join(lines)


TABLE_HEAD = (
    f"{'scenario':13} {'legit OK':>8} {'p99 base/attack ms':>19} {'x':>6} "
    f"{'stall max/p99':>13} {'RSS base/peak/after MiB':>24} {'threads':>10}  "
    f"{'OK':4} {'p99':4} {'stal':4} {'RSS':4}  scenario's own"
)


def table_line(outcome: Outcome) -> str:
    """One line a scenario: the figures, then PASS/FAIL per criterion."""
    if outcome.skipped:
        return f"{outcome.name:13} SKIPPED: {outcome.skipped}"
    (lb, la), (_, ha) = outcome.legit, outcome.health
    criteria = outcome.criteria()
    common, own = criteria[:4], criteria[4:]
    rss, threads = outcome.rss_mib, outcome.threads
    p99 = f"{lb['p99_ms']:.1f}/{la['p99_ms']:.1f}"
    stall = f"{ha['max_ms']:.0f}/{ha['p99_ms']:.0f}"
    memory = f"{rss[0]:.0f}/{rss[1]:.0f}/{rss[2]:.0f}"
    thread_text = f"{threads[0]}/{threads[1]}/{threads[2]}"
    marks = " ".join(f"{verdict(c.passed):4}" for c in common)
    extra = "; ".join(f"{c.name} {c.shown} {verdict(c.passed)}" for c in own) or "-"
    return (
        f"{outcome.name:13} {ok_fraction(la) * 100:7.1f}% {p99:>19} {common[1].shown:>6} "
        f"{stall:>13} {memory:>24} {thread_text:>10}  {marks}  {extra}"
    )
