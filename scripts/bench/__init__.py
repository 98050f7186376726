"""The benchmarks (scripts/bench/bench*.py, each run by its path: `python scripts/bench/bench.py`),
the floors they measure the gateway against (bare_relay.py, floor_picker.py) and the parts
bench.py imports beside it (load_clients, proc_cpu, processes, picker_mode, scaling,
variant; bench_picker: Envoy for the picker mode)."""
