VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The gateway, and the simulated workers + demo (sim/, package gateway_sim): two
# distributions, both installed (editable) in the venv.
CODE := gateway sim tests scripts

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml sim/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,speed]' -e ./sim
	touch $(STAMP)

run: $(STAMP)  ## start the simulated fleet and the gateway, print grpcurl examples
	$(VENV)/bin/gateway demo

test: $(STAMP)  ## lint, type-check and run every test
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/lint-imports
	@# mypy (some 12 s of one core) runs beside the tests at low priority, so the tests that
	@# measure latency keep their cores; its report follows theirs, and either fails the target.
	@nice -n 15 $(VENV)/bin/mypy gateway sim/gateway_sim > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(VENV)/bin/pytest -q; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy gateway sim/gateway_sim"; cat $(VENV)/mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0

bench: $(STAMP)
	$(PY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info sim/build sim/*.egg-info
