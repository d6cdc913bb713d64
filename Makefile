# The two commands a user needs: `make serve` and `make test`. Each creates .venv if missing,
# installs the project into it and prepares the embedded default model.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default; a CUDA user picks a build, e.g.
#   make serve TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
PY := $(VENV)/bin/python

.PHONY: serve test test-full install model lint

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per extra, rebuilt when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[$*]"
	touch $@

install: $(VENV)/.installed-dev

model: $(VENV)/.installed-convert
	$(PY) -m compiled_engine prepare

serve: $(VENV)/.installed-convert
	$(PY) -m compiled_engine prepare
	$(PY) -m compiled_engine serve --port $(PORT)

# The quick tier (under 10 minutes on two cores); `make test-full` runs the wider matrices it
# leaves out (tests marked `full`). CI runs both.
test: $(VENV)/.installed-dev
	$(PY) -m compiled_engine prepare
	$(PY) -m pytest -q

test-full: $(VENV)/.installed-dev
	$(PY) -m compiled_engine prepare
	COMPILED_ENGINE_TEST_TIER=full $(PY) -m pytest -q

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check compiled_engine reference_oracle tests perf
	$(VENV)/bin/ruff format --check compiled_engine reference_oracle tests perf
	$(VENV)/bin/mypy
