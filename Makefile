# `make serve` and `make test` work on a fresh machine: they create .venv and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=

.PHONY: install serve test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# A CPU build of torch where one is on local disk; otherwise leave the user's (CUDA) torch alone.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0 || $(PIP) install -q "torch>=2.9"
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/hyserve serve $(MODEL) --host $(HOST) --port $(PORT)

# one pytest worker per core (pytest-xdist), whole files per worker so module fixtures load once each
WORKERS ?= auto

test: install
	$(PY) -m pytest tests -x -p no:cacheprovider -n $(WORKERS) --dist loadfile; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
