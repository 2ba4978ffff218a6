# node-agent: two commands set up and run everything.
#   make accept   install the agent and run acceptance on this host
#   make test     install what the tests need (system packages too) and run them
# Also: make demo (the simulator on a faulty node), make check (quick suite), make lint,
# make gpu-validate (the GPU proof; README.md "The GPU proof"), make gpu-wheels (its wheels),
# make image (the container image the Kubernetes manifests run; docs/kubernetes.md).
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build of torch for tests and the demo; a GPU host installs the CUDA build with
# `make accept`.
TORCH_TEST_SPEC ?= torch==2.13.0
OUT     ?= out
# Wheels a GPU host without network access needs (scripts/gpu-wheels); git-ignored, copied
# there with the work tree. GPU_HOST_PACKAGES: that host's `python3 -m pip list
# --format=freeze`, so that what it has is left out; GPU_HOST_PYTHON: its Python (X.Y).
WHEELS  ?= .whl
GPU_HOST_PACKAGES ?=
GPU_HOST_PYTHON ?=

.PHONY: accept check demo test test-gpu lint lint-style clean venv deps-test deps-demo nvml-fake \
	gpu-wheels gpu-validate image

# The default install runs everything the README documents (the daemon, its metrics, the
# webhook adapter, py-spy stacks); only torch, the Kubernetes client and the HTML report's
# plotting are extras.
$(BIN)/node-agent: pyproject.toml
	scripts/bootstrap-python "$(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

venv: $(BIN)/node-agent

# On a GPU host the load tests need torch with CUDA (PyPI's default build); without an NVIDIA
# driver there is nothing to compute on and those checks skip with that reason.
$(VENV)/.compute-deps: $(BIN)/node-agent
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet -e '.[torch,report]'; fi
	touch $@

accept: venv $(VENV)/.compute-deps
	$(BIN)/node-agent accept --out $(OUT) $(ARGS)

check: venv
	$(BIN)/node-agent check --out $(OUT) $(ARGS)

# The simulated node's load tests (burn, thermal, HBM, PCIe, SDC) compute on the CPU with
# torch: the pinned CPU build, unless this venv already has a torch (a GPU host's CUDA build).
$(VENV)/.demo-deps: $(BIN)/node-agent
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_TEST_SPEC)"
	touch $@

deps-demo: $(VENV)/.demo-deps

# The faulty scenario is built to grade FAULT, so node-agent exits 4 there: that is the demo
# working, and make says so and exits 0. Any other exit code is a real failure.
demo: deps-demo
	@code=0; $(BIN)/node-agent accept --simulate scenarios/faulty-h100.yaml --out $(OUT)/demo \
		$(ARGS) || code=$$?; \
	if [ $$code -eq 4 ]; then \
		echo "make demo: exit code 4 is the FAULT verdict above, which scenarios/faulty-h100.yaml" \
		     "is built to get (a failed row remap, beside an XID 79, a pending row remap, a hot GPU and a x8 PCIe link): the" \
		     "demo worked."; \
	else \
		echo "make demo: node-agent exited $$code, but the faulty scenario must grade FAULT" \
		     "(exit 4)" >&2; exit 1; \
	fi

# The system packages (apt) and the Python ones download at once: neither needs the other.
# torch comes through pip, whose settings on the host (an index of CPU builds, say) choose its
# build; the rest through uv, which resolves and installs them in seconds where pip took a
# minute (pip does it where uv cannot). Neither compiles bytecode ahead (pip spent half a minute
# of one core on torch's 2,300 files): the tests' processes write it for the modules they
# import (tests/conftest.py).
$(VENV)/.test-deps: $(BIN)/node-agent scripts/install-test-system-deps
	scripts/install-test-system-deps & apt=$$!; \
	$(BIN)/pip install --quiet --no-compile "$(TORCH_TEST_SPEC)" uv \
		&& { $(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev,k8s]' \
			|| { echo "make: uv could not install the test dependencies (above); pip does" >&2; \
				$(BIN)/pip install --quiet --no-compile -e '.[dev,k8s]'; }; }; pip=$$?; \
	wait $$apt; apt=$$?; \
	if [ $$apt -ne 0 ]; then echo "make: scripts/install-test-system-deps failed" >&2; exit $$apt; fi; \
	exit $$pip
	touch $@

deps-test: $(VENV)/.test-deps

# The stand-in libnvidia-ml.so.1 the NVML tests load (docs/nvml_fake.md); a no-op when current.
nvml-fake: venv
	PYTHON="$(abspath $(BIN)/python)" scripts/build-nvml-fake

# The claims the code makes are checked (lint: ruff and the format first, mypy beside the tests,
# its output after theirs), and the tests, every one of them, on TEST_WORKERS pytest-xdist
# workers: three on a 2-core CI machine, where a quarter of the CPU idled under two while tests
# waited on daemons, Slurm and stall timers (on four, timing tests of the daemon, the hang
# sampler and gloo's time limit failed under their load). mypy reads about 3,000 modules (torch's
# and the Kubernetes client's types too): a minute of one core, spent while the workers start
# and wait on their children. --dist loadgroup keeps the tests of one xdist_group on one worker
# (the Slurm test cluster, a module's shared run; pyproject.toml). TEST_WORKERS=0: one process,
# as plain `pytest` runs. make test fails when either fails.
TEST_WORKERS ?= 3
test: lint-style nvml-fake
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	echo "$(BIN)/python -m pytest -q -m \"not gpu\" -n $(TEST_WORKERS) --dist loadgroup $(ARGS)"; \
	$(BIN)/python -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadgroup $(ARGS); tests=$$?; \
	wait $$mypy; typed=$$?; echo "$(BIN)/mypy"; cat $(VENV)/mypy.log; \
	if [ $$typed -ne 0 ]; then echo "make test: mypy found the type errors above" >&2; exit $$typed; fi; \
	exit $$tests

test-gpu: deps-test nvml-fake
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

lint: lint-style
	$(BIN)/mypy

lint-style: deps-test
	$(BIN)/ruff check --no-cache .
	$(BIN)/ruff format --check --no-cache .

# The wheels for a GPU host that reaches no package index, downloaded here.
gpu-wheels: venv
	$(BIN)/python scripts/gpu-wheels $(WHEELS) \
		$(if $(GPU_HOST_PACKAGES),--have $(GPU_HOST_PACKAGES)) \
		$(if $(GPU_HOST_PYTHON),--python-version $(GPU_HOST_PYTHON))

# The GPU proof: out/gpu-validate/figures.json, figures.md and log.txt, in under 9 minutes on
# one H100; on a host without a GPU every figure is null with its reason (exit 0). Needs no
# venv and no install: on a GPU host it runs python3 from the work tree, with the wheels of
# .whl/ where that python3 lacks the agent's dependencies (scripts/gpu-validate).
gpu-validate:
	scripts/gpu-validate $(ARGS)

# The container image (packaging/container/): IMAGE names it, IMAGE_TORCH a torch requirement to
# put in it (none by default; the CUDA build for the stop-check Job). Builds with docker, podman
# or buildah, whichever works here; docs/kubernetes.md.
IMAGE ?= localhost/node-agent:latest
IMAGE_TORCH ?=
image: venv
	$(BIN)/python packaging/container/build-image --tag "$(IMAGE)" \
		$(if $(IMAGE_TORCH),--torch "$(IMAGE_TORCH)")

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info .pytest_cache
