# node-agent: two commands set up and run everything.
#   make accept   install the agent and run acceptance on this host
#   make test     install what the tests need (system packages too) and run them
# Also: make demo (the simulator on a faulty node), make check (quick suite), make lint.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build of torch for tests; a GPU host installs the CUDA build with `make accept`.
TORCH_TEST_SPEC ?= torch==2.13.0
OUT     ?= out

.PHONY: accept check demo test test-gpu lint bench clean venv deps-test

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
		$(BIN)/pip install --quiet -e '.[torch,daemon,report]'; fi
	touch $@

accept: venv $(VENV)/.compute-deps
	$(BIN)/node-agent accept --out $(OUT) $(ARGS)

check: venv
	$(BIN)/node-agent check --out $(OUT) $(ARGS)

demo: venv
	-$(BIN)/node-agent accept --simulate scenarios/faulty-h100.yaml --out $(OUT)/demo $(ARGS)
	@echo "(exit code 4 above is the demo's FAULT verdict)"

$(VENV)/.test-deps: $(BIN)/node-agent scripts/install-test-system-deps
	scripts/install-test-system-deps
	$(BIN)/pip install --quiet "$(TORCH_TEST_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev,daemon,k8s]'
	touch $@

deps-test: $(VENV)/.test-deps

test: deps-test
	$(BIN)/python -m pytest -q -m "not gpu" $(ARGS)

test-gpu: deps-test
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

lint: deps-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(OUT) build *.egg-info .pytest_cache
