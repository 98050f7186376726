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
	$(VENV)/bin/mypy gateway sim/gateway_sim
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info sim/build sim/*.egg-info
