"""The benchmarks (scripts/bench/*.py, each run by its path: `python scripts/bench/bench.py`)
and the floors they measure the gateway against (bare_relay.py, floor_picker.py)."""
