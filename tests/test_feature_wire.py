"""Features on the wire (issue 33): the target returns its features with a verdict, the
orchestrator passes them to a feature-conditioned draft, and the draft serves from them.

What is asserted: the features the draft holds are exactly those the target computed (fp16 on
the wire); the served draft's rows are the model's own teacher-forced rows wherever the
target's features are known, and provisional rows are computed again when they arrive; every
mode's text is the target's (greedy identical to target-only, coupled sampling identical for a
seed); bad features get INVALID_ARGUMENT / FAILED_PRECONDITION and the service goes on; a
request that does not ask costs nothing; the real pair serves a feature draft too."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from conftest import TOKEN_PROMPTS, ServiceThread, generate_on, with_draft_service
from specdec.config import SamplingParams
from specdec.models import feature_model as fm
from specdec.serving.feature_engine import FeatureEngine, wire_features
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc


def feature_draft(target: str, seed: int = 0) -> fm.FeatureDraft:
    """A feature draft for ``target``: its last layer and head, perturbed (nothing symmetric
    by accident), over a reduced vocabulary."""
    torch.manual_seed(seed)
    vocab_map = torch.randperm(49152)[:4096]
    draft = fm.init_from_target(fm.FeatureRecipe(target=target, init_layer=-1), vocab_map, 1.3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
    return draft.eval()


@pytest.fixture(scope="module")
def fdraft_dir(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("fdraft") / "draft"
    fm.save_draft(path, feature_draft(tiny_models["target"]), tiny_models["target"],
                  {"note": "test"})
    return str(path)


@pytest.fixture(scope="module")
def fservices(tiny_services, fdraft_dir, tiny_models):
    yield from with_draft_service(tiny_services, "fdraft", fdraft_dir, tiny_models["target"])


# -- the format and the engine, without the network ----------------------------------------


def test_a_feature_draft_is_refused_where_a_model_engine_is_meant(fdraft_dir):
    """It is a draft only: a target (or eval-draft, which runs plain drafts) refuses it by
    name, instead of failing on missing weights."""
    from specdec.distill.cli import register
    from specdec.models.draft_model import load_engine

    with pytest.raises(ValueError, match="feature-conditioned draft"):
        load_engine(fdraft_dir, torch.device("cpu"))
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval-draft", "--draft", fdraft_dir])
    with pytest.raises(SystemExit, match="specdec distill-feature eval"):
        args.func(args)


def test_saved_draft_loads_as_stored(tiny_models, fdraft_dir):
    """save -> load -> save is a fixed point, and the loaded draft is the trained one to int8
    rounding (its logits within 2% of their spread)."""
    loaded = fm.load_draft(fdraft_dir)
    original = feature_draft(tiny_models["target"])
    feats, toks = torch.randn(1, 12, 64), torch.randint(0, 49152, (1, 12))
    a, b = loaded(feats, toks)[0][0], original(feats, toks)[0][0]
    assert (a - b).abs().max() < 0.02 * b.std() * 10
    assert loaded.feature_out == "norm" and len(loaded.vocab_map) == 4096
    with pytest.raises(ValueError, match="not a feature draft"):
        from specdec.models.draft_model import shipped_draft_dir
        fm.load_draft(shipped_draft_dir())


def test_engine_rows_are_the_models_teacher_forced_rows(fdraft_dir):
    """Given the target's features, the served rows (fed in pieces, as prefill and steps) are
    the model's own forward over the same rows; row t reads the feature of position t - 1."""
    draft = fm.load_draft(fdraft_dir)
    engine = FeatureEngine.from_module(draft, numerics="float")
    cache = engine.new_cache()
    tokens = torch.randint(0, 49152, (20,))
    feats = torch.randn(20, 64)
    s = 5  # first feature: the prompt's last position
    cache.add_features(s, feats[s:15])
    engine.forward([cache], [tokens[:10]], [0])
    got = engine.forward([cache], [tokens[10:16]], [6])[0]  # positions 10..15
    ref = draft(feats[None, s:15], tokens[None, s + 1:16])[0][0][0]  # rows 6..15
    assert torch.allclose(got, ref[-6:], atol=1e-4)
    assert cache.row_start == s + 1 and cache.true_rows == 10


def test_the_split_cores_probe_times_a_feature_draft(fdraft_dir, tiny_models):
    """``specdec bench --split`` first times each side alone and beside the other
    (``bench.contention``): a feature draft loads there as its FeatureEngine, as the draft
    service loads it (it was refused as "not a model engine")."""
    from bench import contention

    m = contention.main(["--target", tiny_models["target"], "--draft", fdraft_dir,
                         "--split", "1:0", "--rows", "1,3", "--reps", "3"])
    assert m["draft_alone"] > 0 and m["draft_with_target"] > 0
    assert set(m["target_with_draft"]) == {1, 3}


def test_provisional_rows_are_computed_again_when_the_features_come(fdraft_dir):
    """Rows drafted on the draft's own predictions (the block in flight) are replaced by rows
    on the target's features once they arrive: the next logits equal a cache that had the
    features all along. (Mutant check: without the recompute they differ.)"""
    draft = fm.load_draft(fdraft_dir)
    engine = FeatureEngine.from_module(draft, numerics="float")
    tokens = torch.randint(0, 49152, (16,))
    feats = torch.randn(16, 64)

    fresh = engine.new_cache()
    fresh.add_features(3, feats[3:14])
    want = engine.forward([fresh], [tokens[:15]], [1])[0]

    cache = engine.new_cache()
    cache.add_features(3, feats[3:8])
    engine.forward([cache], [tokens[:12]], [1])  # rows 9..11 read predictions
    assert cache.true_rows == 5 and cache.rows.length == 8
    cache.add_features(8, feats[8:14])
    got = engine.forward([cache], [tokens[12:15]], [1])[0]
    assert torch.allclose(got, want, atol=1e-4)

    stale = engine.new_cache()  # the mutant: keep the provisional rows
    stale.add_features(3, feats[3:8])
    engine.forward([stale], [tokens[:12]], [1])
    stale.add_features(8, feats[8:14])
    stale.true_rows = stale.rows.length
    assert not torch.allclose(engine.forward([stale], [tokens[12:15]], [1])[0], want, atol=1e-3)


def test_rows_before_any_feature_then_rebased(fdraft_dir):
    """Before any feature (the first round's draft calls) the draft drafts from the asked
    position on zeros and its own predictions; the first features re-base the rows where the
    draft learnt them (after the prompt's last position)."""
    engine = FeatureEngine.from_module(fm.load_draft(fdraft_dir), numerics="float")
    tokens = torch.randint(0, 49152, (12,))
    feats = torch.randn(12, 64)
    cache = engine.new_cache()
    assert engine.forward([cache], [tokens[:8]], [1])[0].abs().sum() > 0
    assert cache.row_start == 7 and cache.rows.length == 1
    cache.add_features(7, feats[7:10])
    got = engine.forward([cache], [tokens[8:11]], [1])[0]
    fresh = engine.new_cache()
    fresh.add_features(7, feats[7:10])
    assert torch.allclose(got, engine.forward([fresh], [tokens[:11]], [1])[0], atol=1e-4)
    assert cache.row_start == 8


def test_sessions_in_one_pass_get_what_each_gets_alone(fdraft_dir):
    """A pass over several sessions (a fresh one, one with provisional rows to redo, one
    drafting on predictions, one before any feature) gives each the logits it gets alone:
    bit for bit in integer numerics, where a row's numbers do not depend on its pass."""
    engine = FeatureEngine.load(fdraft_dir)
    assert engine.numerics == "integer"
    tokens = torch.randint(0, 49152, (16,))
    feats = torch.randn(16, 64)

    def sessions():
        a, b, c, d = (engine.new_cache() for _ in range(4))
        a.add_features(3, feats[3:12])
        b.add_features(3, feats[3:7])
        engine.forward([b], [tokens[:10]], [1])
        b.add_features(7, feats[7:12])
        c.add_features(5, feats[5:9])
        engine.forward([c], [tokens[:11]], [1])
        return [a, b, c, d], [tokens[:14], tokens[10:14], tokens[11:12], tokens[:6]], [2, 1, 1, 1]

    caches, feeds, wanted = sessions()
    together = engine.forward(caches, feeds, wanted)
    caches, feeds, wanted = sessions()
    alone = [engine.forward([c], [f], [n])[0] for c, f, n in zip(caches, feeds, wanted)]
    for t, a in zip(together, alone):
        assert torch.equal(t, a)


def test_fork_and_truncate_keep_what_the_tokens_determine(fdraft_dir):
    engine = FeatureEngine.from_module(fm.load_draft(fdraft_dir), numerics="float")
    cache = engine.new_cache()
    cache.add_features(2, torch.randn(8, 64))
    engine.forward([cache], [torch.randint(0, 49152, (11,))], [1])
    fork = cache.fork(7)
    assert fork.length == 7 and fork.feat_end == 7 and fork.rows.length == 4
    assert cache.length == 11 and cache.rows.length == 8  # the original is untouched
    engine.forward([fork], [torch.tensor([5])], [1])
    assert cache.rows.length == 8 and fork.rows.length == 5


def test_wire_features_parse_and_refuse():
    rows = torch.randn(3, 4).half()
    msg = pb.Features(start=2, dim=4, data=rows.numpy().astype("<f2").tobytes())
    start, got = wire_features(msg, tokens_end=6)
    assert start == 2 and torch.equal(got, rows.float())
    with pytest.raises(ValueError, match="reach past"):
        wire_features(msg, tokens_end=5)
    with pytest.raises(ValueError, match="rows of dim"):
        wire_features(pb.Features(start=0, dim=3, data=b"\0" * 8), tokens_end=9)
    assert wire_features(pb.Features(), tokens_end=3) is None


# -- over the wire -------------------------------------------------------------------------


def _draft_session(service):
    sessions = list(service.runtime.store._sessions.values())
    assert len(sessions) == 1
    return sessions[0]


def _snapshot(service, at: int, seen: dict):
    """A generate_on hook: at the ``at``-th delta, the draft session's tokens and features."""
    async def look(n):
        if n == at:
            s = _draft_session(service)
            seen.update(tokens=list(s.cache.tokens), start=s.cache.feat_start,
                        feats=s.cache.feats.clone())
    return look


def test_features_reach_the_draft_exactly(fservices, tiny_models):
    """Mid-generation, the draft's session holds the target's features of every position from
    the prompt's last on: the fp16 of what the target's engine computes for them in one pass
    over the whole sequence."""
    from specdec.serving.engine import LlamaEngine
    from specdec.models.hub import load_hf_model

    prompt = TOKEN_PROMPTS[1]
    seen = {}
    look = _snapshot(fservices["fdraft"], 8, seen)
    result = asyncio.run(generate_on(fservices, "fdraft", prompt, "spec", 2, max_new=30,
                                     hook=look))
    assert result.stats.draft_failures == 0
    assert seen["start"] == len(prompt) - 1
    n = seen["feats"].shape[0]
    assert n >= 5
    model, _ = load_hf_model(tiny_models["target"])
    engine = LlamaEngine.from_hf(model)
    tokens = seen["tokens"]
    _, ref = engine.forward_features([engine.new_cache()], [torch.tensor(tokens)],
                                     [len(tokens)])
    ref = ref[0][seen["start"]:seen["start"] + n].half().float()
    # float numerics: the kernel a row count runs on is chosen by timing, so two passes may
    # differ by a float32 ulp, which can round to the next float16 (the real pair's test, in
    # integer numerics, asserts bit for bit)
    torch.testing.assert_close(seen["feats"], ref, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("mode", ["spec", "pipelined"])
def test_every_mode_gives_the_targets_text(fservices, mode):
    """Greedy: identical to target-only; coupled sampling: identical for the same seed; the
    draft is used (it proposed tokens) and never failed."""
    for prompt in TOKEN_PROMPTS[:2]:
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=7)):
            ref = asyncio.run(generate_on(fservices, None, prompt, "target-only", 0,
                                          sampling=sampling))
            for k in (1, 3):
                got = asyncio.run(generate_on(fservices, "fdraft", prompt, mode, k,
                                              sampling=sampling))
                assert got.token_ids == ref.token_ids, (prompt, sampling, k)
                assert got.stats.draft_failures == 0
                assert got.stats.num_drafts > 0


def test_rejection_rule_runs_on_the_feature_draft(fservices):
    sampling = SamplingParams(temperature=0.8, seed=3, rule="rejection")
    got = asyncio.run(generate_on(fservices, "fdraft", TOKEN_PROMPTS[0], "spec", 2,
                                  sampling=sampling))
    assert got.stats.draft_failures == 0 and len(got.token_ids) == 40


def _verify(stub, sid, tokens, prefix=0, **kw):
    from specdec.serving.session import rolling_hash

    return stub.Verify(pb.VerifyRequest(
        session=pb.SessionRef(session_id=sid, prefix_len=prefix,
                              prefix_hash=rolling_hash(tokens[:prefix]) if prefix else 0),
        tokens=tokens[prefix:], **kw), timeout=30)


def test_target_returns_the_positions_it_adds(fservices):
    """return_features: rows of max(prefix_len, features_from) .. cache_len - 1; none
    unasked."""
    with grpc.insecure_channel(fservices["target"].address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        tokens = [1, 520, 3300, 12, 99, 7]
        plain = _verify(stub, "tf-plain", tokens)
        assert not plain.HasField("features")
        r = _verify(stub, "tf", tokens, return_features=True, features_from=4)
        assert r.features.start == 4 and r.cache_len == 6
        assert len(r.features.data) == 2 * 2 * r.features.dim and r.features.dim == 64
        tokens = tokens + [r.next_token]
        r2 = _verify(stub, "tf", tokens, prefix=6, draft_tokens=[5, 6, 7],
                     return_features=True, features_from=4, decode_on=0)
        rows = len(r2.features.data) // (2 * 64)
        assert r2.features.start == 6 and rows == 1 + r2.num_accepted
        assert r2.cache_len == 7 + r2.num_accepted
        tokens += [5, 6, 7][:r2.num_accepted] + [r2.next_token]
        r3 = _verify(stub, "tf", tokens, prefix=r2.cache_len, return_features=True,
                     features_from=4, decode_on=3)
        assert len(r3.decoded) == 3
        assert r3.features.start == r2.cache_len
        assert len(r3.features.data) // 128 == r3.cache_len - r2.cache_len == 4
        for sid in ("tf-plain", "tf"):  # (the target is shared: leave no session)
            stub.CloseSession(pb.CloseRequest(session_id=sid), timeout=30)


def test_bad_features_are_refused_and_the_draft_goes_on(fservices):
    from specdec.serving.session import rolling_hash

    with grpc.insecure_channel(fservices["fdraft"].address) as ch:
        stub = pb_grpc.DraftServiceStub(ch)
        tokens = [1, 520, 3300, 12, 99, 7, 8]

        def propose(sid, feats, prefix=0, toks=tokens):
            return stub.Propose(pb.DraftRequest(
                session=pb.SessionRef(session_id=sid, prefix_len=prefix,
                                      prefix_hash=rolling_hash(toks[:prefix]) if prefix else 0),
                tokens=toks[prefix:], k=2, features=feats), timeout=30)

        def rows(start, n, dim=64):
            return pb.Features(start=start, dim=dim,
                               data=torch.randn(n, dim).half().numpy().tobytes())

        for feats, code, words in (
                (rows(5, 1, dim=32), grpc.StatusCode.INVALID_ARGUMENT, "dim 64"),
                (rows(4, 3), grpc.StatusCode.INVALID_ARGUMENT, "reach past"),
                (pb.Features(start=0, dim=64, data=b"\0" * 7), grpc.StatusCode.INVALID_ARGUMENT,
                 "rows of dim")):
            with pytest.raises(grpc.RpcError) as err:
                propose("bad", feats)
            assert err.value.code() == code and words in err.value.details()
        ok = propose("good", rows(5, 1))
        assert len(ok.tokens) == 2
        with pytest.raises(grpc.RpcError) as err:  # a gap: positions 6.. missing
            propose("good", rows(7, 1), prefix=7, toks=tokens + [3, 4])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(fservices["draft"].address) as ch:  # a plain draft ignores them
        plain = pb_grpc.DraftServiceStub(ch)
        assert len(plain.Propose(pb.DraftRequest(
            session=pb.SessionRef(session_id="p"), tokens=tokens, k=2, features=rows(5, 1)),
            timeout=30).tokens) == 2
        plain.CloseSession(pb.CloseRequest(session_id="p"), timeout=30)  # (shared service)


def test_pair_refuses_a_feature_draft_of_another_width(fservices):
    from orchestrator.pair import FeatureMismatch, check_pair

    target = pb.ModelInfo(model="t", tokenizer_fingerprint="x", feature_dim=64)
    check_pair(target, pb.ModelInfo(model="d", tokenizer_fingerprint="x", features=True,
                                    feature_dim=64))
    check_pair(target, pb.ModelInfo(model="d", tokenizer_fingerprint="x"))  # a plain draft
    with pytest.raises(FeatureMismatch, match="width 576"):
        check_pair(target, pb.ModelInfo(model="d", tokenizer_fingerprint="x", features=True,
                                        feature_dim=576))


# -- the real pair ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["", "2,14"], ids=["final", "layers"])
def real_feature_pair(request, tmp_path_factory):
    """The default target's service and a feature draft trained (a few steps) on its own
    answers with features and exported through the CLI: what a user serves after
    ``python -m specdec.distill.feature_draft train`` and ``export``; one reading the final
    feature, one also the target's layers 2 and 14 (``--feature-layers``)."""
    from specdec.models.feature_model import parse_layers

    from specdec.distill import feature_draft as fd
    from specdec.distill.cli import _engine_and_tokenizer
    from specdec.distill.data import load_shards, write_shards
    from specdec.distill.prompts import held_out_set

    root = tmp_path_factory.mktemp("real-fdraft")
    engine, tokenizer, eos = _engine_and_tokenizer("default")
    shards = write_shards(engine, tokenizer, held_out_set("handwritten", 4), root / "data", eos,
                          max_new_tokens=24, batch_size=4, temperatures=(0.0,),
                          prompts_per_shard=4, features=True,
                          feature_layers=parse_layers(request.param))
    assert all("features" in r for r in load_shards(shards))
    del engine
    fd.main(["train", "--data", str(root / "data"), "--out", str(root / "run"), "--steps", "2",
             "--batch", "2", "--warmup", "1", "--feature-layers", request.param])
    from orchestrator.cli import main as specdec  # the user's command
    assert specdec(["distill-feature", "export", "--out", str(root / "run"), "--draft-out",
                    str(root / "draft")]) == 0
    services = {"target": ServiceThread("target", "default"),
                "fdraft": ServiceThread("draft", str(root / "draft"))}
    yield services, root, parse_layers(request.param)
    for s in services.values():
        s.stop()


@pytest.mark.real
def test_real_pair_serves_the_trained_feature_draft(real_feature_pair):
    """The exported draft is the trained one; served beside the default target (integer
    numerics: a row is the same number in any pass) the draft holds the target's features
    bit for bit (with its layers' rows, where it reads them), and greedy and coupled text is
    target-only's in spec and pipelined mode."""
    from specdec.distill import feature_draft as fd
    from specdec.models.hub import load_tokenizer
    from specdec.models.loading import load_engine
    from specdec.models.tokenizer import encode_prompt

    services, root, layers = real_feature_pair
    trained, *_ = fd.trained(root / "run")
    served = fm.load_draft(root / "draft")
    for name, p in trained.params.items():  # int8 rows: within ~half a step (fp16 scales)
        step = p.detach().abs().amax(dim=-1, keepdim=True) / 127 if p.dim() == 2 else \
            1e-3 * p.abs().max()
        assert ((served.params[name] - p).abs() <= step * 0.6 + 1e-6).all(), name
    assert torch.equal(served.tap_mean, trained.tap_mean)  # (float16 numbers: stored exactly)
    assert torch.equal(served.tap_std, trained.tap_std)
    info = services["fdraft"].runtime.info
    assert info.features and info.feature_dim == 576 * (1 + len(layers))
    assert list(info.feature_layers) == list(layers)

    tok = load_tokenizer("default")
    prompt = encode_prompt(tok, "Name three rivers in Europe and say where each one ends.",
                           None)
    seen = {}
    look = _snapshot(services["fdraft"], 10, seen)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=11)):
        ref = asyncio.run(generate_on(services, None, prompt, "target-only", 0, max_new=32,
                                      sampling=sampling))
        for mode in ("spec", "pipelined"):
            got = asyncio.run(generate_on(services, "fdraft", prompt, mode, 2, max_new=32,
                                          sampling=sampling, hook=look))
            assert got.token_ids == ref.token_ids, (mode, sampling)
            assert got.stats.draft_failures == 0 and got.stats.num_drafts > 0
    engine, _, _ = load_engine("default", torch.device("cpu"))
    tokens = seen["tokens"]
    _, ref = engine.forward_features([engine.new_cache()], [torch.tensor(tokens)], [len(tokens)],
                                     layers=layers)
    n = seen["feats"].shape[0]
    assert seen["start"] == len(prompt) - 1 and n >= 5
    assert torch.equal(seen["feats"], ref[0][seen["start"]:seen["start"] + n].half().float())


def test_the_speculation_cache_branches_on_the_feature_draft(fservices):
    """A branch call (the block in flight, then width candidates per verdict) on the feature
    draft: every verdict's branches come back, drafted on the draft's own features past the
    target's, and the same call again gives the same branches (forks share nothing)."""
    from specdec.serving.session import rolling_hash

    tokens = [1, 520, 3300, 12, 99, 7, 8, 9, 10]  # history of 7, then a block of 2
    feats = pb.Features(start=4, dim=64, data=torch.randn(2, 64).half().numpy().tobytes())
    with grpc.insecure_channel(fservices["fdraft"].address) as ch:
        stub = pb_grpc.DraftServiceStub(ch)

        def branches(prefix):
            return stub.Propose(pb.DraftRequest(
                session=pb.SessionRef(session_id="br", prefix_len=prefix,
                                      prefix_hash=rolling_hash(tokens[:prefix]) if prefix
                                      else 0),
                tokens=tokens[prefix:], k=3, features=feats if not prefix else None,
                branches=pb.BranchSpec(block_len=2, width=2, depth=3)), timeout=30)

        first = branches(0)
        again = branches(6)  # the history's last token is fed again, as the client does
    got = [(b.accepted, b.token, list(b.tokens)) for b in first.branches]
    assert sorted({j for j, _, _ in got}) == [0, 1, 2]
    assert all(len(t) == 3 for _, _, t in got) and len(got) >= 5
    assert got == [(b.accepted, b.token, list(b.tokens)) for b in again.branches]
