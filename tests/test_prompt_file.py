"""``specdec generate --prompt-file``: one prompt per line, or JSONL with prompts and chats."""

import json
import subprocess
import sys

import pytest

from orchestrator.cli import read_prompt_file
from specdec.models.hub import load_tokenizer
from specdec.models.tokenizer import encode_prompt

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]


def test_jsonl_lines_hold_prompts_with_newlines_and_whole_chats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "line one\nline two"}) + "\n\n"
                    + json.dumps({"messages": CHAT}) + "\n")
    assert read_prompt_file(str(path)) == ["line one\nline two", CHAT]
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\nsecond\n")
    assert read_prompt_file(str(plain)) == ["first", "second"]


@pytest.mark.parametrize("line, why", [
    ("not json", "not a JSON object"),
    (json.dumps({"text": "x"}), 'needs a "prompt" string or a "messages" list'),
    (json.dumps({"messages": [{"role": "user"}]}), '"messages" list'),
    (json.dumps({"messages": []}), '"messages" list'),
    (json.dumps(["x"]), 'needs a "prompt"'),
])
def test_bad_jsonl_lines_are_refused_with_their_line_number(tmp_path, line, why):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=why) as info:
        read_prompt_file(str(path))
    assert ":2:" in str(info.value)


def test_generate_runs_each_jsonl_prompt_and_chat(tmp_path, tiny_models):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Once upon\na time"}) + "\n"
                    + json.dumps({"messages": CHAT}) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "generate", "--json", "--prompt-file",
         str(path), "--max-new-tokens", "4", "--target", tiny_models["target"],
         "--draft", tiny_models["near_draft"], "--threads", "1"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["Once upon\na time", CHAT]
    tok = load_tokenizer(tiny_models["target"])
    assert rows[1]["prompt_tokens"] == len(encode_prompt(tok, CHAT, None))
    assert rows[0]["prompt_tokens"] == len(encode_prompt(tok, "Once upon\na time", None))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "generate", "--prompt-file",
                          str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "bad.jsonl:1: not a JSON object" in out.stderr
    assert "Traceback" not in out.stderr
