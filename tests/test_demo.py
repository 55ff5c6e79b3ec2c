"""`specdec generate --compare` (what `make demo` runs): the speculative run, then the same
prompt on the target alone, both speeds and whether the tokens are identical."""

import re
import subprocess
import sys


def test_compare_prints_both_speeds_the_speedup_and_identical_tokens(tiny_models):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "generate", "Once upon a time",
         "--max-new-tokens", "12", "--compare", "--target", tiny_models["target"],
         "--draft", tiny_models["near_draft"], "--threads", "1", "--k", "2"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    err = out.stderr
    rows = dict(re.findall(r"^  (.+?)\s+(\d+) tokens\s+[\d.]+ tok/s$", err, re.M))
    assert set(rows) == {"speculative (spec)", "target alone (specdec target-only)",
                         "target alone (transformers generate)"}, err[-1500:]
    assert len(set(rows.values())) == 1  # the same number of tokens in every run
    line = err.strip().splitlines()[-1]
    assert re.match(r"speedup [\d.]+x over the target alone through specdec, [\d.]+x over "
                    r"transformers generate; generated tokens identical in every run$", line), line
