"""The feature-conditioned (EAGLE-style) draft: step API against whole-sequence passes, the
chain mask, the round simulation, data alignment, and that training learns."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.distill import feature_draft as fd
from specdec.models import feature_model as fm
from specdec.distill.train import simulate_tokens_per_round

VOCAB, HIDDEN = 64, 32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rope_theta=10000.0,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def tiny_draft(seed: int = 0, vocab_out: int = 48, init_layer: int = 1) -> fd.FeatureDraft:
    vocab_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:vocab_out]
    recipe = fd.FeatureRecipe(init_layer=init_layer)
    draft = fd.init_from_target(recipe, vocab_map, feature_scale=1.5, model=tiny_target(seed))
    with torch.no_grad():  # a random fc and a perturbed layer: nothing symmetric by accident
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


def test_init_copies_target_layer_and_head():
    model = tiny_target(3)
    vocab_map = torch.tensor([5, 1, 9, 0])
    draft = fd.init_from_target(fd.FeatureRecipe(init_layer=1), vocab_map, 2.0, model=model)
    layer = model.model.layers[1]
    assert torch.equal(draft.params["w_down"], layer.mlp.down_proj.weight)
    assert torch.equal(draft.params["wqkv"][: HIDDEN], layer.self_attn.q_proj.weight)
    assert torch.equal(draft.params["head"], model.lm_head.weight[vocab_map])
    assert torch.equal(draft.embed, model.model.embed_tokens.weight)
    assert torch.equal(draft.params["norm"], model.model.norm.weight)  # predicts such features
    residual = fd.init_from_target(fd.FeatureRecipe(init_layer=1, feature_out="residual"),
                                   vocab_map, 2.0, model=model)
    assert torch.allclose(residual.params["norm"], torch.full((HIDDEN,), 2.0))


def test_step_token_by_token_equals_teacher_forced_forward():
    draft = tiny_draft(1)
    t = 11
    feats, tokens = torch.randn(1, t, HIDDEN), torch.randint(0, VOCAB, (1, t))
    (logits, h), = draft(feats, tokens)
    cache = draft.new_cache()
    got_l, got_h = [], []
    for chunk in ([0], [1, 2, 3], [4], [5, 6], [7, 8, 9, 10]):  # one row and several at once
        lg, hh = draft.step(cache, feats[0, chunk], tokens[0, chunk])
        got_l.append(lg), got_h.append(hh)
    assert cache.length == t
    torch.testing.assert_close(torch.cat(got_l), logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(got_h), h[0], atol=1e-5, rtol=1e-5)


def test_chain_passes_equal_drafting_with_the_step_api():
    """forward(passes=3) pass s at row r == what a server drafting from true row r-s+1 sees:
    true rows up to the start, then its own predicted features (truncating after)."""
    draft = tiny_draft(2)
    t, passes = 9, 3
    feats, tokens = torch.randn(1, t, HIDDEN), torch.randint(0, VOCAB, (1, t))
    outs = draft(feats, tokens, passes=passes)
    cache = draft.new_cache()
    for c in range(t):
        lg, h = draft.step(cache, feats[0, c : c + 1], tokens[0, c : c + 1])  # true row c
        torch.testing.assert_close(lg[0], outs[0][0][0, c], atol=1e-5, rtol=1e-5)
        for s in range(2, passes + 1):  # draft on: own feature, the (teacher-forced) token
            r = c + s - 1
            if r >= t:
                break
            lg, h = draft.step(cache, h, tokens[0, r : r + 1])
            torch.testing.assert_close(lg[0], outs[s - 1][0][0, r], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h[0], outs[s - 1][1][0, r], atol=1e-5, rtol=1e-5)
        cache.truncate(c + 1)  # the target's verdict: drafted rows dropped
    # a batch of padded sequences gives the same rows as one sequence alone
    b_feats = torch.cat([feats, torch.randn(1, t, HIDDEN)])
    b_tokens = torch.cat([tokens, torch.randint(0, VOCAB, (1, t))])
    b_feats[1, 6:], b_tokens[1, 6:] = 0, 0
    short = draft(b_feats[1:, :6], b_tokens[1:, :6], passes=passes)
    batched = draft(b_feats, b_tokens, passes=passes)
    for s in range(passes):
        torch.testing.assert_close(batched[s][0][0], outs[s][0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched[s][0][1, :6], short[s][0][0], atol=1e-5, rtol=1e-5)


def test_chain_mask():
    m = fm.chain_mask(2, 3).int()
    expected = torch.tensor([
        # pass 1 keys | pass 2 keys
        [1, 0, 0, 0, 0, 0],  # pass 1, row 0: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],  # pass 2, row 0: no start row (never scored), itself
        [1, 0, 0, 0, 1, 0],  # pass 2, row 1: chain from true row 0, then itself
        [1, 1, 0, 0, 0, 1],
    ])
    assert torch.equal(m, expected)
    m3 = fm.chain_mask(3, 5)
    q = 2 * 5 + 4  # pass 3, row 4: chain from true row 2, its pass-2 row 3, itself
    assert m3[q].nonzero().squeeze(1).tolist() == [0, 1, 2, 5 + 3, 10 + 4]


def test_chain_simulation_matches_independent_draft_simulation():
    """With runs made from position-wise agreement, the chain simulation is
    simulate_tokens_per_round's."""
    rng = random.Random(0)
    agree = [[rng.random() < 0.6 for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    runs = []
    for row in agree:
        run = []
        for j in range(len(row)):
            m = 0
            while j + m < len(row) and row[j + m]:
                m += 1
            run.append(m)
        runs.append(run)
    for k in (1, 2, 3, 4, 8):
        assert fd.simulate_chain_tokens_per_round(runs, k) == pytest.approx(
            simulate_tokens_per_round(agree, k))
    assert fd.simulate_chain_tokens_per_round([[0, 3, 0, 0, 0, 0]], 4) == pytest.approx(6 / 3)


def synthetic_records(n: int, seed: int = 0, length: int = 20) -> tuple[list[dict], torch.Tensor]:
    """The 'target' writes a[i+1] = (3 a[i] + 1) % 40; its feature before token x is F[x]."""
    table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 1.5
    g = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(n):
        a = [int(torch.randint(0, 40, (1,), generator=g))]
        for _ in range(length - 1):
            a.append((3 * a[-1] + 1) % 40)
        a = torch.tensor(a)
        top_ids = torch.stack([torch.cat([x[None], torch.tensor([(x + 1 + j) % VOCAB for j in range(31)])])
                               for x in a]).int()
        top_lp = torch.full((length, 32), -12.0)
        top_lp[:, 0] = -0.01
        records.append(dict(prompt=torch.tensor([1, 2, 3], dtype=torch.int32),
                            answer=a.int(), top_ids=top_ids, top_logprobs=top_lp.half(),
                            features=table[a].half(), temperature=0.0, conversation=0))
    return records, table


def test_examples_align_rows_with_next_token_targets():
    records, table = synthetic_records(3, length=7)
    vocab_map = torch.arange(VOCAB).flip(0)
    ex = fd.FeatureExamples(vocab_map, VOCAB)
    assert ex.add(records + [dict(records[0], answer=records[0]["answer"][:1])]) == 3 * 6
    b = ex.batch([0, 1])
    a = records[0]["answer"].long()
    assert b["tokens"][0].tolist() == a.tolist()
    assert b["valid"][0].tolist() == [True] * 6 + [False]
    # row r's targets: the target's distribution for answer[r + 1], in draft ids
    assert b["top_ids"][0, :6, 0].tolist() == (VOCAB - 1 - a[1:]).tolist()
    assert (b["top_ids"][0, 6] == -1).all()
    torch.testing.assert_close(b["next_features"][0, :6], table[a[1:]].half().float())
    torch.testing.assert_close(b["features"][0], table[a].half().float())


@pytest.mark.parametrize("unroll", [1, 2])
def test_training_learns_the_next_token_and_feature(tmp_path, unroll):
    records, _ = synthetic_records(48)
    vocab_map = torch.arange(48)
    recipe = fd.FeatureRecipe(steps=120, batch=8, lr=3e-3, warmup=5, unroll=unroll,
                              noise=0.05, feature_weight=1.0)
    torch.manual_seed(0)
    draft = fd.init_from_target(recipe, vocab_map, fd.feature_rms(records), model=tiny_target(4))
    ex = fd.FeatureExamples(vocab_map, VOCAB)
    ex.add(records)
    held_records, _ = synthetic_records(8, seed=1)
    held = fd.FeatureExamples(vocab_map, VOCAB)
    held.add(held_records)
    before = fd.evaluate(draft, held, k_max=3)
    batch = ex.batch(list(range(16)))
    loss0 = fd.chain_losses(draft, batch, recipe, train=False)[0].item()
    figures = fd.train(draft, ex, recipe, tmp_path / "train.ckpt", progress=False)
    loss1 = fd.chain_losses(draft, batch, recipe, train=False)[0].item()
    after = fd.evaluate(draft, held, k_max=3)
    assert figures["steps"] == 120 and (tmp_path / "train.ckpt").exists()
    assert loss1 < 0.3 * loss0
    assert before["step_agreement"]["step1"] < 0.3
    assert after["step_agreement"]["step1"] > 0.95
    if unroll == 2:  # trained on its own features, the chain's later steps agree too
        assert after["step_agreement"]["step2"] > 0.8
        assert after["tokens_per_round"]["3"] > 2.5


def test_training_resumes_from_checkpoint(tmp_path):
    records, _ = synthetic_records(16)
    vocab_map = torch.arange(48)
    ex = fd.FeatureExamples(vocab_map, VOCAB)
    ex.add(records)

    def run(steps):
        recipe = fd.FeatureRecipe(steps=steps, batch=4, lr=1e-3, warmup=2)
        draft = fd.init_from_target(recipe, vocab_map, 1.0, model=tiny_target(5))
        return draft, fd.train(draft, ex, recipe, tmp_path / "train.ckpt", progress=False)

    draft, figures = run(100)
    saved = {k: v.clone() for k, v in draft.state_dict().items()}
    draft2, figures2 = run(100)  # finished: nothing more to do, weights as saved
    assert figures2["rows_seen"] == 0
    for k, v in draft2.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_the_lever_studys_baseline_is_the_feature_draft_and_its_taps_start_from_it():
    """bench/feature_levers.py scores variants against a baseline: with one tap its draft reads
    its input exactly as the feature draft does; with three, a fresh fc starts as that draft,
    and a chained row (its own final feature only) reads the other taps as their means."""
    from bench.feature_levers import LeverDraft

    draft = tiny_draft(7)
    scale = float(draft.feature_scale)
    feats, tokens = torch.randn(2, 5, HIDDEN) * 1.5, torch.randint(0, VOCAB, (2, 5))

    def lever(mean, std):
        d = LeverDraft(draft.arch, draft.embed, draft.vocab_map, scale)
        d.load_state_dict(draft.state_dict(), strict=False)
        d.use_taps(mean, std)
        return d.eval()

    one = lever(torch.zeros(1, HIDDEN), torch.full((1, HIDDEN), scale))
    with torch.no_grad():
        assert torch.allclose(one.rows(feats, tokens), draft.rows(feats, tokens), atol=1e-6)
        mean, std = torch.randn(3, HIDDEN), torch.rand(3, HIDDEN) + 0.5
        mean[2], std[2] = 0.0, scale
        three = lever(mean, std)
        full = torch.cat([mean[0].expand(2, 5, -1), mean[1].expand(2, 5, -1), feats], -1)
        assert torch.equal(three.rows(feats, tokens), three.rows(full, tokens))
        assert torch.allclose(three.rows(feats, tokens), draft.rows(feats, tokens), atol=1e-5)
        moved = full.clone()
        moved[..., :HIDDEN] += 1.0  # the low tap read: the rows change
        assert not torch.allclose(three.rows(moved, tokens), three.rows(full, tokens))


def test_the_lever_studys_final_rows_are_the_engines_features():
    """The study's tapped pass (the engine's, layers tapped) gives, as its last tap,
    exactly the features the target service sends, for records of different lengths batched."""
    from bench.feature_levers import tapped_features
    from specdec.models.loading import load_engine

    engine, _, _ = load_engine("default", torch.device("cpu"))
    if engine.native is None:
        pytest.skip("the study's pass runs on specdec's native kernels")
    records = [dict(prompt=torch.tensor([1, 520, 3300, 12]), answer=torch.tensor([99, 7, 8, 9])),
               dict(prompt=torch.tensor([1, 42]), answer=torch.tensor([5, 6, 7, 8, 9, 10, 11]))]
    for r, full in zip(records, tapped_features(engine, records)):
        seq = torch.cat([r["prompt"], r["answer"][:-1]])
        _, ref = engine.forward_features([engine.new_cache()], [seq], [len(seq)])
        assert full.shape == (len(seq), 3, engine.arch.hidden_size)
        assert torch.equal(full[:, 2], ref[0].half())
        assert not torch.equal(full[:, 0], full[:, 1]) and torch.isfinite(full.float()).all()
