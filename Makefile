# The two commands of the README: `make demo` and `make test`. Both set up .venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed

.PHONY: setup demo test bench distill clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 is the CPU wheel; keep any torch >= 2.4 already installed (e.g. CUDA).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdec generate "Explain in a few sentences why the sky is blue." --max-new-tokens 128

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/specdec bench

clean-venv:
	rm -rf $(VENV)
