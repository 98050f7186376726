VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,speed]'
	touch $(STAMP)

run: $(STAMP)  ## start the simulated fleet and the gateway, print grpcurl examples
	$(VENV)/bin/gateway demo

test: $(STAMP)  ## lint, type-check and run every test
	$(VENV)/bin/ruff check gateway tests scripts
	$(VENV)/bin/ruff format --check gateway tests scripts
	$(VENV)/bin/mypy gateway
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(PY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
