"""`specdec bench` end to end on the tiny pair: the table, the JSON, the plots, the exactness check."""

import json
import subprocess
import sys

import pytest


def test_bench_prints_the_table_writes_json_and_plots_and_checks_every_system(tmp_path, tiny_models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ("Tell me a story.", "Explain gravity.")) + "\n")
    out = tmp_path / "out"
    systems = "hf,hf-assisted,specdec-target-only,specdec-spec,specdec-pipelined,specdec-ngram"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--prompts", str(prompts),
         "--target", tiny_models["target"], "--draft", tiny_models["near_draft"],
         "--max-new-tokens", "12", "--systems", systems, "--threads", "1", "--hf-threads", "1",
         "--k", "2",  # tiny draft and target cost alike: adaptive k would not draft
         "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all specdec systems' greedy token ids equal HF target-only's" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for system in systems.split(","):
        assert any(f"| {system} |" in line for line in table), system
    data = json.loads((out / "bench.json").read_text())
    runs = data["runs"]
    assert len(runs) == 2 * len(systems.split(","))
    reference = {r["prompt_index"]: r["token_ids"] for r in runs if r["system"] == "hf"}
    for r in runs:
        assert r["token_ids"] == reference[r["prompt_index"]], r["system"]
    spec = [r for r in runs if r["system"] == "specdec-spec"]
    assert all(r["rounds"] > 0 for r in spec)
    assert sum(r["draft_tokens"] for r in spec) > 0  # the near draft was used
    for png in ("tokens_per_s.png", "tokens_per_round.png", "timeline.png"):
        assert (out / png).stat().st_size > 1000


def test_bench_split_times_the_cores_separation_then_runs_each_service_on_its_own(tmp_path,
                                                                                   tiny_models):
    """`specdec bench --split 1:0` on the tiny pair: the cores' separation (the target's forward
    and the draft's step, alone and side by side) before the runs, in the output and the JSON,
    then the runs, every text the target's."""
    out = tmp_path / "out"
    stdout = _cli("bench", "--prompts", "default", "--limit", "1", "--target",
                  tiny_models["target"], "--draft", tiny_models["near_draft"],
                  "--max-new-tokens", "8", "--systems", "hf,specdec-target-only,specdec-spec",
                  "--split", "1:0", "--k", "2", "--out", str(out))
    assert "all specdec systems' greedy token ids equal HF target-only's" in stdout
    assert "split cores' separation before the runs" in stdout
    summary = json.loads((out / "bench.json").read_text())["summary"]
    assert summary["split"] == {"target": [1], "draft": [0]}
    sep = summary["separation"]
    assert sep["cores"] == {"target": [1], "draft": [0]}  # as each model process ran
    assert sep["draft"] == tiny_models["near_draft"]
    assert set(sep["target_alone"]) == set(sep["target_with_draft"]) == {"1", "5"}
    assert sep["draft_alone"] > 0 and sep["draft_with_target"] > 0


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_rules_measures_both_rules_and_the_coupled_texts_agree(tmp_path, tiny_models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ("Tell me a story.", "Explain gravity.")) + "\n")
    out = tmp_path / "out"
    stdout = _cli("bench-rules", "--prompts", str(prompts), "--target", tiny_models["target"],
                  "--draft", tiny_models["near_draft"], "--max-new-tokens", "10",
                  "--noise-draws", "24", "--temperatures", "1.0", "--e2e", "--threads", "1",
                  "--decode-on", "0",  # (as in the concurrency test below)
                  "--out", str(out))
    assert "| 1.0 | spec coupled |" in stdout and "| 1.0 | pipelined rejection |" in stdout
    data = json.loads((out / "rules.json").read_text())
    r = data["results"]["1.0"]
    assert 0.0 < r["coupled_floor"] <= r["rejection"] <= 1.0
    # the estimate of the coupled rule's acceptance lies between its floor and 1 - TV
    assert r["coupled_floor"] - 0.1 < r["coupled"] < r["rejection"] + 0.1
    e2e = data["e2e"]
    for label in ("spec coupled", "pipelined coupled"):
        row = e2e[f"1.0|{label}"]
        assert row["same_as_target_only"] == row["runs"] == 2, label
    assert e2e["1.0|spec rejection"]["drafted"] > 0


def test_bench_divergence_counts_differences_and_margins(tmp_path, tiny_models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n")
    out = tmp_path / "out"
    stdout = _cli("bench-divergence", "--prompts", str(prompts), "--target",
                  tiny_models["target"], "--draft", tiny_models["near_draft"],
                  "--max-new-tokens", "12", "--threads", "1", "--out", str(out))
    data = json.loads((out / "divergence.json").read_text())
    assert set(data) == {"greedy", "coupled T=0.8"}
    for kind, rows in data.items():
        assert rows["differ"] == {"specdec-spec": 0, "specdec-pipelined": 0}, kind
        assert rows["positions"] == 12 and 0 < rows["smallest_margins"][0] < float("inf")
    assert "| greedy | specdec-spec | 0/1 | 12 |" in stdout


def test_bench_concurrency_runs_every_system_at_every_level_against_target_only(tmp_path,
                                                                              tiny_models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ("Tell me a story.", "Explain gravity.")) + "\n")
    out = tmp_path / "out"
    stdout = _cli("bench", "--concurrency", "1,2", "--prompts", str(prompts),
                  "--target", tiny_models["target"], "--draft", tiny_models["near_draft"],
                  "--max-new-tokens", "8", "--threads", "1", "--hf-threads", "1",
                  "--requests-per-client", "2", "--repeats", "2", "--out", str(out),
                  # a round trip per plain token: on the tiny pair, whose calls cost more than
                  # its passes, decoding on beats any block, so spec would never draft
                  "--decode-on", "0")
    assert "every specdec answer's greedy token ids equal HF target-only's" in stdout
    assert "vs specdec-target-only" in stdout
    data = json.loads((out / "concurrency.json").read_text())
    rows = {(r["system"], r["concurrency"]): r for r in data["rows"]}
    systems = ("hf", "specdec-target-only", "specdec-spec", "specdec-pipelined")
    assert set(rows) == {(s, n) for s in systems for n in (1, 2)}
    for (system, n), r in rows.items():
        assert r["mismatches"] == 0 and r["tokens"] > 0, system
        assert f"| {system} | {n} |" in stdout
        # specdec's clients send 2 requests each (the next when the answer arrives); HF n
        assert r["requests"] == (n if system == "hf" else 2 * n), (system, n)
    assert "| specdec-target-only | 2 | " in stdout and " | 1.00x [1.00-1.00] | " in stdout
    # two sweeps: HF timed in the first only, the specdec systems in a rotated order each time,
    # each row the median of its sweeps with their range and the within-sweep ratio
    assert data["repeats"] == 2
    order = [(r["repeat"], r["concurrency"], r["system"]) for r in data["runs"]]
    assert order[:4] == [(0, 1, s) for s in systems]
    assert [s for rep, n, s in order if (rep, n) == (1, 1)] == \
        ["specdec-spec", "specdec-pipelined", "specdec-target-only"]
    for (system, n), r in rows.items():
        runs = [x for x in data["runs"] if (x["system"], x["concurrency"]) == (system, n)]
        assert r["repeats"] == len(runs) == (1 if system == "hf" else 2)
        lo, hi = r["tokens_per_s_range"]
        assert lo <= r["tokens_per_s"] <= hi and [lo, hi] == \
            [min(x["tokens_per_s"] for x in runs), max(x["tokens_per_s"] for x in runs)]
        if system != "hf":
            alone = {x["repeat"]: x["tokens_per_s"] for x in data["runs"]
                     if (x["system"], x["concurrency"]) == ("specdec-target-only", n)}
            ratios = sorted(x["tokens_per_s"] / alone[x["repeat"]] for x in runs)
            assert r["vs_target_only"] == pytest.approx(sum(ratios) / 2)  # median of two
            assert r["vs_target_only_range"] == pytest.approx(ratios)
    # what the rounds did: target-only never drafts, spec alone drafts (a near draft), and
    # every row's tokens per round matches its tokens over its rounds
    assert rows[("specdec-target-only", 2)]["drafted_rounds"] == 0
    assert rows[("specdec-target-only", 2)]["tokens_per_round"] == 1.0
    assert rows[("specdec-spec", 1)]["drafted_rounds"] > 0
    assert "tokens_per_round" not in rows[("hf", 1)]
    for (system, n), r in rows.items():
        if system != "hf":
            assert r["tokens_per_round"] == pytest.approx(r["tokens"] / r["rounds"]), system
    assert (out / "concurrency.png").stat().st_size > 1000


def test_rpc_floor_measures_both_call_kinds_at_each_wait():
    """The model-free gRPC floor (bench.rpc_floor): a row per server-side wait, each with the
    bidirectional stream's and the unary call's overhead beyond that wait."""
    from bench import rpc_floor

    rows = rpc_floor.main(["--wait-ms", "0,5", "--calls", "6"])
    assert [r["wait_ms"] for r in rows] == [0, 5]
    for r in rows:
        assert r["stream_ms"] > 0 and r["unary_ms"] > 0


def test_a_pipelined_round_under_contention_runs_each_side_at_its_rate_until_one_is_done():
    """bench.contention's round model on crafted costs: without contention a pipelined round is
    its longer side; two equal sides that each halve the other's speed gain nothing over running
    one after the other; otherwise the side left over finishes alone at full speed."""
    from bench.contention import bounds, pipelined_round_ms

    assert pipelined_round_ms(40.0, 30.0, 1.0, 1.0) == 40.0
    assert pipelined_round_ms(30.0, 30.0, 0.5, 0.5) == 60.0
    # the verify (30 alone) ends at 40; by then the draft did 20 of its 40, the rest alone
    assert pipelined_round_ms(40.0, 30.0, 0.5, 0.75) == pytest.approx(60.0)
    # the draft (12 alone) ends at 24; the verify did 18 of its 30
    assert pipelined_round_ms(12.0, 30.0, 0.5, 0.75) == pytest.approx(36.0)
    measured = {"draft_alone": 10.0, "draft_with_target": 20.0,
                "target_alone": {1: 25.0, 3: 30.0}, "target_with_draft": {1: 50.0, 3: 60.0}}
    (row,) = bounds(measured)  # k = 0 is no round to overlap
    assert row["k"] == 2 and row["sequential_ms"] == 50.0
    assert row["pipelined_ms"] == pytest.approx(50.0) and row["bound"] == pytest.approx(1.0)
    assert row["bound_separate"] == pytest.approx(50.0 / 30.0)


def test_contention_times_each_model_alone_and_beside_the_other_on_split_cores(tiny_models):
    """python -m bench.contention on the tiny pair, one core each: every probe timed alone and
    with the other side running, and a bound per block length."""
    from bench import contention

    m = contention.main(["--target", tiny_models["target"], "--draft", tiny_models["draft"],
                         "--split", "1:0", "--rows", "1,3", "--reps", "3"])
    assert set(m["target_alone"]) == set(m["target_with_draft"]) == {1, 3}
    assert all(v > 0 for v in [*m["target_alone"].values(), *m["target_with_draft"].values(),
                               m["draft_alone"], m["draft_with_target"]])
    assert [r["k"] for r in m["bounds"]] == [2]


def test_the_concurrency_table_leaves_vs_n1_empty_when_n1_was_not_run():
    """`--concurrency 4,8` has no N = 1 row to compare with: '-' (it printed 'nanx')."""
    from bench.concurrency import table

    def row(system, n, tps):
        return dict(system=system, concurrency=n, repeats=1, tokens_per_s=tps, p50_s=1.0,
                    p95_s=1.0, mismatches=0, vs_target_only=1.0)

    assert "| specdec-target-only | 4 | 80.0 | - | 1.00x |" in \
        table({"rows": [row("specdec-target-only", 4, 80.0)]})
    assert "| specdec-target-only | 4 | 80.0 | 2.00x | 1.00x |" in \
        table({"rows": [row("specdec-target-only", 1, 40.0), row("specdec-target-only", 4, 80.0)]})


def test_llamacpp_systems_are_compared_by_agreement_not_counted_as_mismatches():
    """llama.cpp computes with 8-bit activations: its text departing from HF's after a near tie
    is reported as agreement; a specdec system that departs is still a mismatch."""
    from bench.harness import Run
    from bench.llamacpp import agreement
    from bench.report import summarize, table

    assert agreement([1, 2, 3, 9], [1, 2, 3, 4]) == 3 and agreement([5], [1, 2]) == 0

    def run(system, tokens):
        return Run(system=system, prompt_set="s", prompt_index=0, token_ids=tokens, wall_s=1.0)

    hf = [1, 2, 3, 4]
    summary = summarize([run("hf", hf), run("llamacpp", [1, 2, 7, 7]),
                         run("specdec-target-only", [1, 2, 7, 7])],
                        ["hf", "llamacpp", "specdec-target-only"], ["s"], [])
    assert summary["mismatches"] == [("specdec-target-only", "s", 0)]
    cpp = next(r for r in summary["rows"] if r["system"] == "llamacpp")
    assert cpp["agreement_with_hf"] == 0.5
    assert "| llamacpp (agrees on 50%) |" in table(summary)


def test_under_integer_numerics_specdec_target_only_is_the_reference():
    """A GGUF target on CPU computes integer numerics (the default): its text is not HF's
    float32, so every specdec system is checked against specdec target-only and compared with
    HF as agreement; a system departing from target-only is still a mismatch."""
    from bench.harness import Run
    from bench.report import summarize

    def run(system, tokens, i=0):
        return Run(system=system, prompt_set="s", prompt_index=i, token_ids=tokens, wall_s=1.0)

    systems = ["hf", "specdec-target-only", "specdec-spec", "specdec-pipelined"]
    runs = [run("hf", [1, 2, 3, 4]), run("specdec-target-only", [1, 2, 7, 7]),
            run("specdec-spec", [1, 2, 7, 7]), run("specdec-pipelined", [1, 2, 7, 8])]
    summary = summarize(runs, systems, ["s"], [], reference="specdec-target-only")
    assert summary["mismatches"] == [("specdec-pipelined", "s", 0)]
    assert summary["reference"] == "specdec-target-only"
    rows = {r["system"]: r for r in summary["rows"]}
    assert rows["specdec-spec"]["agreement_with_hf"] == 0.5
    assert "agreement_with_hf" not in rows["hf"]
    # against HF (float numerics) the same runs are three mismatches
    assert len(summarize(runs, systems, ["s"], [])["mismatches"]) == 3


def test_the_streaming_bound_reads_the_gguf_tensors_and_the_machine_bandwidth():
    from bench.llamacpp import streaming_bound, weight_bytes
    from bench.report import bound_line
    from specdec.models.hub import default_gguf_path

    path = default_gguf_path()
    size = weight_bytes(path)
    assert 0.9 * path.stat().st_size < size < path.stat().st_size  # tensor data, not metadata
    bound = streaming_bound("default", [1])
    assert bound["weight_mb"] == size / 1e6
    assert bound[1]["read_gbs"] > 0.1
    assert abs(bound[1]["bound_ms"] - size / (bound[1]["read_gbs"] * 1e9) * 1e3) < 1e-6
    assert streaming_bound("/not/a/gguf/dir", [1]) is None
    assert "measured T(1) in service 12.0 ms" in bound_line(bound, [12.0, 13.0])


def test_bench_runs_llamacpp_on_the_default_gguf(tmp_path):
    """With llama-cpp-python installed: both llama.cpp systems run beside HF on the same file,
    greedy, and agree with HF's float32 text on most of a short answer."""
    pytest.importorskip("llama_cpp")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name three colors of the rainbow."}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--prompts", str(prompts),
         "--max-new-tokens", "16", "--systems", "hf,llamacpp,llamacpp-prompt-lookup",
         "--hf-threads", "1", "--out", str(out), "--bound"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weight-streaming bound" in proc.stdout
    rows = json.loads((out / "bench.json").read_text())["summary"]["rows"]
    for system in ("llamacpp", "llamacpp-prompt-lookup"):
        row = next(r for r in rows if r["system"] == system)
        assert row["tokens"] > 0 and row["agreement_with_hf"] >= 0.5, row


def test_bench_verify_times_llamacpp_beside_specdec(tmp_path, monkeypatch):
    """`bench-verify --engines integer,llamacpp`: llama.cpp's forward over m rows on the same
    file, each probe cut back to the context, so every probe computes the same rows (mutant:
    without the cut the positions grow past the context within a few reps). Without
    llama-cpp-python the column is refused with the install line."""
    from bench import llamacpp

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "llama_cpp", None)  # as if not installed
        assert llamacpp.forward_timer("default", 1, list(range(10, 169)), 150) is None
    pytest.importorskip("llama_cpp")
    timer = llamacpp.forward_timer("default", 1, list(range(10, 74)), 60)
    assert timer(4) > 0
    first = [list(row) for row in timer.model.scores[60:64]]
    for _ in range(12):  # 12 x 4 rows would overflow the 72-position context without the cut
        assert timer(4) > 0
    assert [list(row) for row in timer.model.scores[60:64]] == first
    del timer
    out = tmp_path / "out"
    stdout = _cli("bench-verify", "--engines", "integer,llamacpp", "--no-service",
                  "--max-tokens", "3", "--reps", "2", "--threads", "1", "--out", str(out))
    assert "| m | integer | llamacpp |" in stdout
    med = json.loads((out / "verify_cost.json").read_text())["median_ms"]
    assert all(med["llamacpp"][str(m)] > 0 for m in (1, 2, 3))


@pytest.mark.real
def test_on_the_default_target_bench_checks_against_specdec_target_only(tmp_path):
    """The real pair in its default integer numerics: `specdec bench` adds specdec
    target-only as the reference and passes only if every specdec run equals it; the
    concurrency sweep does the same (HF is timed, not checked)."""
    out = tmp_path / "out"
    stdout = _cli("bench", "--prompts", "default", "--limit", "1", "--max-new-tokens", "8",
                  "--systems", "hf,specdec-spec", "--threads", "1", "--hf-threads", "1",
                  "--out", str(out))
    assert "all specdec systems' greedy token ids equal specdec target-only's" in stdout
    summary = json.loads((out / "bench.json").read_text())["summary"]
    assert summary["reference"] == "specdec-target-only" and not summary["mismatches"]
    rows = {r["system"]: r for r in summary["rows"]}
    assert set(rows) == {"hf", "specdec-target-only", "specdec-spec"}
    assert 0.0 <= rows["specdec-spec"]["agreement_with_hf"] <= 1.0
    stdout = _cli("bench", "--concurrency", "1", "--prompts", "default", "--limit", "1",
                  "--max-new-tokens", "8", "--threads", "1", "--hf-threads", "1",
                  "--requests-per-client", "1", "--out", str(out))
    assert "every specdec answer's greedy token ids equal specdec target-only's" in stdout
    assert json.loads((out / "concurrency.json").read_text())["reference"] == \
        "specdec-target-only"


def test_bench_without_prompt_lookup_drafts_every_block_with_the_draft_model(tiny_models):
    """--no-prompt-lookup: a prompt the history repeats still gets the draft model's blocks
    (its acceptance alone); with lookup on the same prompt takes lookup blocks."""
    from bench.harness import SpecdecSystems

    prompt = [5, 6, 7, 8] * 10
    lookups = {}
    for lookup in (True, False):
        spd = SpecdecSystems(tiny_models["target"], tiny_models["near_draft"], 1,
                             ["specdec-spec"], prompt_lookup=lookup)
        try:
            spd.connect()
            run = spd.run("specdec-spec", prompt, 16, 2)
        finally:
            spd.close()
        assert run.rounds > 0 and run.draft_tokens > 0
        lookups[lookup] = run.lookup_rounds
    assert lookups[True] > 0 and lookups[False] == 0
