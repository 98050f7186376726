"""The attack harness behind `scripts/attack.py`: scenarios that attack a gateway while a
legitimate client and a health prober, each a process of its own, measure what the
attack costs everyone else.

- `measure`: the two observer processes (their `main`s) and the pure statistics;
- `harness`: one scenario's run (processes stopped on every path, the scenario's steps);
- `observe`: the observer processes asked from the run, the gateway's memory and threads
  sampled;
- `outcome`: what a scenario measured, the pass criteria, the table;
- `readings`: what scenarios read off their calls and the gateway's /metrics;
- `scenarios`: the attacks, one class each, registered by name (with `queue_scenarios`,
  `discovery_scenarios`, `worker_scenarios`, `affinity_reload_scenarios`,
  `picker_scenarios` and `picker_access_scenarios`; `picker_client`: ext_proc spoken to
  the picker's port).
"""
