# Set-up and everyday commands. `make build` and `make test` install on demand.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install build test lint format regen regen-measure docs bench clean

install: $(STAMP)

# The venv is rebuilt when pyproject.toml changes (stale) or when it is missing.
$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (install it, e.g. 'pyenv install 3.12.1')" >&2; exit 2; }
	@if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
		rm -rf $(VENV); $(PYTHON312) -m venv $(VENV); fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

build: $(STAMP)
	$(VENV)/bin/mkgen build kimi-k3 --topology 2x2x4 --rows 8 --draft kimi-k3-mtp --fuse-draft

# Two workers: the interpret-mode kernels run one core each, and the machines have two.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

# mypy checks the kernel's runtime library (mkgen/kernellib; settings in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check mkgen tests scripts
	$(VENV)/bin/ruff format --check mkgen tests scripts
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix mkgen tests scripts
	$(VENV)/bin/ruff format mkgen tests scripts

# Rebuild the checked-in builds listed in generated/BUILDS (byte-identical when nothing
# changed); regen-measure also compiles and verifies each and records it in REPORT.md.
regen: $(STAMP)
	$(PY) -m mkgen.cli regen

regen-measure: $(STAMP)
	$(PY) -m mkgen.cli regen --measure

# Rerun the README's example commands and rewrite their blocks (scripts/make_docs.py).
docs: $(STAMP)
	$(PY) scripts/make_docs.py

# How long mkgen's commands take (scripts/bench.py), then a bounded load test of mkgen serve
# on loopback (32 clients, 200 requests, the tiny qwen3 fixture in interpret mode) and a
# soak test: normal traffic mixed with hostile requests for at most 240 s.
bench: $(STAMP)
	$(PY) scripts/bench.py
	$(PY) scripts/serve_load.py --clients 32 --requests 200
	$(PY) scripts/serve_soak.py --seconds 240 --requests 400

clean:
	rm -rf $(VENV) .pytest_cache
