"""The `tenant` label of per-tenant metrics: the busiest tenants by name, the rest as
`other`, so clients naming tenants cannot create series at will.

Misra-Gries over `size` entries (a newcomer takes a free entry, else counts every entry
down by one, freeing those at 0) keeps any tenant with more than 1/(size+1) of the calls
whatever the crowd behind it, and unlike space-saving never evicts a tenant to admit a
newcomer. A tenant is named from its `name_after`-th counted call (2) until it loses its
entry, so one-off tenants passing through free entries stay in `other` instead of each
creating, then removing, a series (and taking its count along); counts are halved every
`halve_every` calls, so the ranking follows recent traffic, not the process's lifetime.
"""

from __future__ import annotations

from typing import NamedTuple

OTHER = "other"
NONE: tuple[str, ...] = ()


class Labelled(NamedTuple):
    """One call's label, and the named tenants that lost their entry before it was
    labelled (remove their series first, then count the call under `label`)."""

    label: str
    evicted: tuple[str, ...]


class TenantLabels:
    """At most `size` tenants named at once (plus `other`); O(1) for a tenant holding an
    entry, O(size) otherwise. Pure: no clock, no I/O, the same calls give the same labels."""

    __slots__ = ("_calls", "_counts", "_named", "halve_every", "name_after", "size")

    def __init__(self, size: int = 20, *, name_after: int = 2, halve_every: int = 10_000) -> None:
        if size < 0:
            raise ValueError(f"size must be at least 0, got {size}")
        if name_after < 1 or halve_every < 1:
            raise ValueError(f"name_after {name_after}, halve_every {halve_every}: both >= 1")
        self.size = size
        self.name_after = name_after
        self.halve_every = halve_every
        self._counts: dict[str, int] = {}  # tenant -> its count (insertion order kept)
        self._named: set[str] = set()  # the tenants holding an entry that are named
        self._calls = 0

    def count(self, tenant: str) -> Labelled:
        """Count one call of `tenant`: its label, and who lost their name meanwhile."""
        evicted = NONE
        self._calls += 1
        if self._calls >= self.halve_every:  # before labelling: the label stays live
            self._calls = 0
            evicted = self._keep({name: held // 2 for name, held in self._counts.items()})
        counts = self._counts
        mine = counts.get(tenant)
        if mine is not None:
            counts[tenant] = mine = mine + 1
        elif tenant == OTHER:  # a tenant really named so is never told apart from the rest
            return Labelled(OTHER, evicted)
        elif len(counts) < self.size:
            counts[tenant] = mine = 1
        else:  # full: this call and one of each entry's cancel out
            rest = {name: held - 1 for name, held in counts.items()}
            return Labelled(OTHER, evicted + self._keep(rest))
        if tenant in self._named:
            return Labelled(tenant, evicted)
        if mine >= self.name_after:
            self._named.add(tenant)
            return Labelled(tenant, evicted)
        return Labelled(OTHER, evicted)

    def tenants(self) -> list[str]:
        """The tenants named now, first admitted first."""
        return [name for name in self._counts if name in self._named]

    def _keep(self, counts: dict[str, int]) -> tuple[str, ...]:
        """Keep the entries left above 0; the named tenants whose entry went."""
        gone = tuple(name for name, held in counts.items() if held <= 0 and name in self._named)
        self._named.difference_update(gone)
        self._counts = {name: held for name, held in counts.items() if held > 0}
        return gone
