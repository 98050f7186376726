"""The attack harness behind `scripts/attack.py`: scenarios that attack a gateway while a
legitimate client and a health prober, each a process of its own, measure what the
attack costs everyone else.

- `measure`: the two observer processes (their `main`s) and the pure statistics;
- `harness`: one scenario's run (processes stopped on every path, the observers, the
  gateway's memory and threads sampled, the pass criteria, the table);
- `scenarios`: the attacks, one class each, registered by name.
"""
