"""The time-boxed GPU draft build (specdec.distill.gpu), run here on CPU on a tiny target."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import hf_greedy


def step(*args):
    """One step of ``python -m specdec.distill.gpu``, as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "specdec.distill.gpu", *args],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_batched_answers_match_the_targets_own_greedy_despite_left_padding(tiny_models):
    from specdec.distill.gpu import answer_batch
    from specdec.models.hub import load_hf_model

    target = tiny_models["target"]
    model, _ = load_hf_model(target)
    prompts = [torch.tensor(p, dtype=torch.int32)
               for p in ([5, 17, 99, 3], [42] * 11, [7, 8, 9, 10, 11, 12, 200])]
    temps = torch.tensor([0.0, 0.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    recs = answer_batch(model, prompts, temps, eos=[0], pad=0, max_new=16, top_n=8, gen=gen)
    assert len(recs) == 3
    for p, r in zip(prompts[:2], recs[:2]):
        ref = hf_greedy(target, p.tolist(), 16)
        n = len(r["answer"])
        assert r["answer"].tolist() == ref[:n]  # shorter only when it stopped at EOS
        assert n == 16 or r["answer"][-1] == 0
        # the kept top-N is the target's distribution at each answer position
        assert r["top_ids"].shape == (n, 8) and torch.equal(r["top_ids"][:, 0], r["answer"])
        assert bool((r["top_logprobs"][:, :-1] >= r["top_logprobs"][:, 1:]).all())
    sampled = recs[2]
    assert sampled["temperature"] == 1.0
    assert 0 < len(sampled["answer"]) <= 16
    assert int(sampled["answer"].max()) < model.config.vocab_size


def test_prepare_run_finish_builds_an_evaluated_draft(tmp_path, tiny_models):
    target = tiny_models["target"]
    work = tmp_path / "d"
    step("prepare", "--out", str(work), "--target", target, "--prompts", "6",
         "--heldout-prompts", "2", "--max-new-tokens", "12")
    step("run", "--out", str(work), "--target", target, "--gen-seconds", "120",
         "--train-seconds", "5", "--gen-batch", "4", "--max-new-tokens", "12",
         "--temperatures", "0,1", "--layers", "0,1", "--vocab", "600", "--batch", "4",
         "--warmup", "2", "--eval-every", "5")
    gpu_card = json.loads((work / "gpu-card.json").read_text())
    assert gpu_card["data"]["answers"] == 12  # 6 prompts x 2 temperatures, well inside budget
    assert gpu_card["training"]["steps"] >= 20
    assert 1 <= gpu_card["training"]["kept_step"] <= gpu_card["training"]["steps"]
    step("finish", "--out", str(work), "--target", target)
    meta = json.loads((work / "draft" / "draft.json").read_text())
    held = meta["card"]["held_out"]
    assert 0 < meta["vocab_out"] <= 600 and held["held_out_tokens"] > 0
    assert 0.0 <= held["greedy_acceptance"] <= 1.0

    from specdec.models.loading import load_engine

    engine, _, _ = load_engine(str(work / "draft"), torch.device("cpu"))
    cache = engine.new_cache()
    logits = engine.forward([cache], [torch.tensor([1, 2, 3])], [1])[0]
    assert logits.shape[-1] == meta["vocab_out"] and torch.isfinite(logits).all()


def test_answers_keep_the_features_the_engine_gives(tiny_models):
    """With features, each answer token's row is the final norm's output at the position
    that predicted it: specdec's engine's feature over prompt + answer (float numerics, to
    float rounding), and the answers are the same as without."""
    from specdec.distill.gpu import answer_batch
    from specdec.models.hub import load_hf_model
    from specdec.serving.engine import LlamaEngine

    model, _ = load_hf_model(tiny_models["target"])
    prompts = [torch.tensor(p, dtype=torch.int32) for p in ([5, 17, 99, 3], [42] * 9)]
    temps = torch.tensor([0.0, 0.0])
    plain = answer_batch(model, prompts, temps, [0], 0, 12, 8, torch.Generator().manual_seed(0))
    recs = answer_batch(model, prompts, temps, [0], 0, 12, 8, torch.Generator().manual_seed(0),
                        features=True)
    engine = LlamaEngine.from_hf(model, numerics="float")
    for p, r, q in zip(prompts, recs, plain):
        assert torch.equal(r["answer"], q["answer"])
        n = len(r["answer"])
        seq = torch.cat([p, r["answer"][:-1]]).long()
        _, feats = engine.forward_features([engine.new_cache()], [seq], [n])
        assert r["features"].shape == (n, model.config.hidden_size)
        torch.testing.assert_close(r["features"].float(), feats[0], atol=2e-2, rtol=1e-2)


def test_answers_keep_the_layers_the_engine_taps(tiny_models):
    """With feature layers, each answer token's record also holds the residual after those
    layers (``taps``, hooks on transformers' decoder layers), as specdec's engine taps them,
    and the same final features as without."""
    from specdec.distill.gpu import answer_batch
    from specdec.models.hub import load_hf_model
    from specdec.serving.engine import LlamaEngine

    model, _ = load_hf_model(tiny_models["target"])
    prompts = [torch.tensor(p, dtype=torch.int32) for p in ([5, 17, 99, 3], [42] * 9)]
    temps = torch.tensor([0.0, 0.0])
    args = (model, prompts, temps, [0], 0, 12, 8)
    plain = answer_batch(*args, torch.Generator().manual_seed(0), features=True)
    recs = answer_batch(*args, torch.Generator().manual_seed(0), features=True,
                        feature_layers=(0, 1))
    assert not model.model.layers[0]._forward_hooks  # (the hooks are removed)
    engine = LlamaEngine.from_hf(model, numerics="float")
    hidden = model.config.hidden_size
    for p, r, q in zip(prompts, recs, plain):
        n = len(r["answer"])
        assert torch.equal(r["answer"], q["answer"]) and torch.equal(r["features"], q["features"])
        assert r["taps"].shape == (n, 2, hidden) and r["tap_layers"].tolist() == [0, 1]
        seq = torch.cat([p, r["answer"][:-1]]).long()
        _, rows = engine.forward_features([engine.new_cache()], [seq], [n], layers=(0, 1))
        torch.testing.assert_close(r["taps"].float(), rows[0][:, :2 * hidden].view(n, 2, hidden),
                                   atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("layers", ["", "0"])
def test_prepare_run_finish_builds_an_evaluated_feature_draft(tmp_path, tiny_models, layers):
    """``run --kind feature``: the data keeps features, the feature draft trains on them;
    ``finish`` writes a servable feature draft and its held-out figures (with
    ``--feature-layers``, a draft that reads those layers too)."""
    from specdec.models import draft_model
    from specdec.serving.feature_engine import FeatureEngine

    target = tiny_models["target"]
    work = tmp_path / "f"
    step("prepare", "--out", str(work), "--target", target, "--prompts", "6",
         "--heldout-prompts", "2", "--max-new-tokens", "12")
    step("run", "--out", str(work), "--target", target, "--kind", "feature", "--gen-seconds",
         "120", "--train-seconds", "5", "--gen-batch", "4", "--max-new-tokens", "12",
         "--temperatures", "0,1", "--vocab", "600", "--batch", "4", "--warmup", "2",
         "--feature-layers", layers)
    card = json.loads((work / "gpu-card.json").read_text())
    assert card["kind"] == "feature" and card["data"]["answers"] == 12
    assert card["training"]["steps"] >= 20
    step("finish", "--out", str(work), "--target", target)
    assert draft_model.is_feature_draft(str(work / "draft"))
    held = draft_model.read_meta(work / "draft")["card"]["held_out"]
    assert held["rows"] > 0 and 0.0 <= held["step_agreement"]["step1"] <= 1.0
    engine = FeatureEngine.load(work / "draft")
    cache = engine.new_cache()
    assert engine.feature_width == engine.hidden * (1 + len(layers))
    cache.add_features(2, torch.randn(1, engine.feature_width))
    logits = engine.forward([cache], [torch.tensor([1, 2, 3, 4])], [1])[0]
    assert logits.shape == (1, engine.vocab_out) and torch.isfinite(logits).all()
