"""``specdec bench-gpu --tiny``: the GPU bench's script runs on CPU with random tiny models, writes
its JSON and prints its table (the figures a GPU run fills in: docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO


def test_bench_gpu_tiny_writes_the_costs_and_the_bound(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "bench-gpu", "--tiny",
                          "--device", "cpu", "--k", "3", "--context", "32", "--reps", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["dtype"] == "float32" and r["k"] == 3
    assert list(r["target_ms"]) == ["1", "2", "3", "4"]
    assert all(v > 0 for v in r["target_ms"].values()) and r["draft_ms"] > 0
    assert r["target_weight_bytes"] > 0 and r["bound_ms"] > 0 and r["copy_bandwidth_gbs"] > 0
    assert set(r["tokens_per_s"]) == {"target_only", "spec_a0.5", "spec_a0.7", "spec_a0.9"}
    assert "weight-bandwidth bound" in run.stdout and f"wrote {out}" in run.stdout


def test_the_random_engines_are_their_shapes_in_the_dtype_asked():
    from bench.gpu import random_engine, spec_model, weight_bytes

    engine = random_engine("tiny", torch.device("cpu"), torch.bfloat16)
    assert engine.dtype == torch.bfloat16 and engine.arch.num_layers == 2
    # embedding read one row per token: the bound counts the head and layers, not it
    h, v = 64, 512
    per_layer = ((4 + 2 * 2) * 16 * h + h * 4 * 16 + 2 * 128 * h + h * 128 + 2 * h) * 2
    assert weight_bytes(engine) == 2 * per_layer + (v * h + h) * 2
    logits = engine.forward([engine.new_cache()], [torch.arange(5)], [1])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # a draft that costs nothing and is always right: k + 1 tokens per T(k + 1)
    tps = spec_model({1: 10.0, 5: 10.0}, 0.0, 4)
    assert tps["target_only"] == 100.0 and abs(tps["spec_a0.9"] - 100.0 * 4.0951) < 1e-6
