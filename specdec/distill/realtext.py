"""Training prompts built from real text that is on every machine: Python's standard library.

Template prompts (``prompts.py``) are all phrased alike, and a draft trained on them agrees
with the target less on what users actually write (docs/draft.md: the GPU run's draft made
0.541 on the templated held-out set, 0.460 on the handwritten one). Users paste passages and code and ask for
something done with them, so this set does that with real, varied text available offline:
paragraphs of the standard library's documentation (``pydoc_data.topics``, module and
function docstrings) and the source of its functions, each under a varied, often casual,
instruction. The texts depend only on the Python that runs ``prepare``; the tokenized prompts
are what the GPU run reads.
"""

from __future__ import annotations

import ast
import pathlib
import random
import sysconfig

TEXT_TASKS = [
    "Summarize this in two sentences:\n\n{x}",
    "Explain this to me like I'm new to programming:\n\n{x}",
    "Rewrite this paragraph in plain English:\n\n{x}",
    "Turn this into a short bulleted list of the key points:\n\n{x}",
    "What is the main point of the following text?\n\n{x}",
    "{x}\n\nCan you explain what this means?",
    "{x}\n\ntl;dr?",
    "Make this shorter and clearer, keep the meaning:\n\n{x}",
    "Write three quiz questions (with answers) based on this text:\n\n{x}",
    "Give me an example that illustrates this:\n\n{x}",
    "i dont get this part, can u help?\n\n{x}",
    "Rewrite this as a friendly message to a coworker:\n\n{x}",
    "What questions might a reader still have after reading this?\n\n{x}",
    "Is anything in this text unclear or ambiguous? Explain.\n\n{x}",
]

CODE_TASKS = [
    "Explain what this Python function does:\n\n```python\n{x}\n```",
    "Can you walk me through this code step by step?\n\n```python\n{x}\n```",
    "Write a short docstring for this function:\n\n```python\n{x}\n```",
    "Are there any edge cases this code does not handle?\n\n```python\n{x}\n```",
    "```python\n{x}\n```\nwhat does this do?",
    "Suggest a simpler or more readable version of this code:\n\n```python\n{x}\n```",
    "Write a unit test for this function:\n\n```python\n{x}\n```",
    "Describe the inputs and the output of this function:\n\n```python\n{x}\n```",
    "How would you explain this code to a beginner?\n\n```python\n{x}\n```",
    "Add comments to this code:\n\n```python\n{x}\n```",
]

NAME_TASKS = [
    "How do I use {x} in Python?",
    "what is {x} for",
    "Show me a small example of {x}.",
    "When should I use {x}, and when not?",
    "Can you explain {x} with an example?",
]


def _paragraphs(text: str, lo: int, hi: int) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        para = "\n".join(ln.rstrip() for ln in para.strip().splitlines())
        if lo <= len(para) <= hi and sum(c.isalpha() for c in para) > 0.6 * len(para):
            out.append(para)
    return out


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


MAX_CHARS = 700  # a prompt of ~200 tokens leaves most of a 384-token training row to the answer


def sources(max_code_lines: int = 24) -> dict[str, list[str]]:
    """Passages, function sources and qualified names from the standard library."""
    texts: list[str] = []
    code: list[str] = []
    names: list[str] = []
    try:
        from pydoc_data.topics import topics

        for key in sorted(topics):
            texts.extend(_paragraphs(topics[key], 150, MAX_CHARS))
    except ImportError:  # some distributions strip pydoc_data
        pass
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        lines = source.splitlines()
        doc = ast.get_docstring(tree)
        if doc:
            texts.extend(_paragraphs(doc, 150, MAX_CHARS))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            names.append(f"{module}.{node.name}")
            doc = ast.get_docstring(node)
            if doc:
                texts.extend(_paragraphs(doc, 150, MAX_CHARS))
            if isinstance(node, ast.FunctionDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                body = lines[start:node.end_lineno]
                if 4 <= len(body) <= max_code_lines and len("\n".join(body)) <= MAX_CHARS:
                    code.append("\n".join(body))
    # Deduplicate, keeping order (the same docstring is often inherited or repeated).
    return {k: list(dict.fromkeys(v)) for k, v in (("text", texts), ("code", code),
                                                    ("name", names))}


def real_text_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts: a passage, a function or a name from the standard library under a task."""
    src = sources()
    kinds = [("text", TEXT_TASKS)] * 5 + [("code", CODE_TASKS)] * 4 + [("name", NAME_TASKS)]
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        kind, tasks = kinds[rng.randrange(len(kinds))]
        pool = src[kind]
        if not pool:
            kind, tasks = "name", NAME_TASKS
            pool = src[kind]
        prompts.append(tasks[rng.randrange(len(tasks))].format(x=pool[rng.randrange(len(pool))]))
    return prompts
