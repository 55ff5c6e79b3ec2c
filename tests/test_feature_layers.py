"""A feature draft that reads target layers beside the final feature (issue 33: the feature
layers, EAGLE-3's low / middle / final input): the engine's tapped rows, the target service's
VerifyRequest.feature_layers, the draft's standardised input and its rows on its own
predictions, the data and the draft file, and every mode's text on a served pair."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from conftest import TOKEN_PROMPTS, generate_on, with_draft_service
from specdec.config import SamplingParams
from specdec.models import feature_model as fm
from specdec.serving.feature_engine import FeatureEngine
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

LAYERS = (0, 1)  # the tiny target's two layers (its last one's residual: before the norm)
H = 64  # the tiny target's hidden size


def tapped_draft(target: str, seed: int = 0) -> fm.FeatureDraft:
    """A feature draft for ``target`` reading its layers 0 and 1, with tap statistics that
    are not zero / one (a mean not read is caught), perturbed as the one-layer test draft."""
    torch.manual_seed(seed)
    vocab_map = torch.randperm(49152)[:4096]
    stats = ((torch.randn(2, H) * 0.5).half().float(), (torch.rand(2, H) + 0.5).half().float())
    draft = fm.init_from_target(fm.FeatureRecipe(target=target, feature_layers="0,1"),
                                vocab_map, 1.3, tap_stats=stats)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
        draft.fc.weight[:, : 2 * H].normal_(0, 0.05)  # the taps' columns matter
    return draft.eval()


@pytest.fixture(scope="module")
def tapped_dir(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("tdraft") / "draft"
    fm.save_draft(path, tapped_draft(tiny_models["target"]), tiny_models["target"], {})
    return str(path)


@pytest.fixture(scope="module")
def tservices(tiny_services, tapped_dir, tiny_models):
    yield from with_draft_service(tiny_services, "tdraft", tapped_dir, tiny_models["target"])


def _engine(tiny_models):
    from specdec.models.hub import load_hf_model
    from specdec.serving.engine import LlamaEngine

    model, _ = load_hf_model(tiny_models["target"])
    return model, LlamaEngine.from_hf(model)


# -- the target's rows ------------------------------------------------------------------------


def test_the_engine_taps_each_layers_output(tiny_models):
    """forward_features(layers=...) rows are [each layer's output; the final feature]: the
    layers' as transformers' decoder layers give them, the final feature and the logits
    exactly those of the call without layers (which may run the whole stack in one call)."""
    model, engine = _engine(tiny_models)
    seq = torch.tensor([1, 520, 3300, 12, 99, 7, 8, 41])
    logits, plain = engine.forward_features([engine.new_cache()], [seq], [3])
    got_logits, rows = engine.forward_features([engine.new_cache()], [seq], [3], layers=LAYERS)
    assert rows[0].shape == (3, 3 * H)
    assert torch.equal(rows[0][:, 2 * H:], plain[0]) and torch.equal(got_logits[0], logits[0])
    outs = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in LAYERS]
    try:
        with torch.no_grad():
            model(seq[None])
    finally:
        for h in hooks:
            h.remove()
    for j, i in enumerate(LAYERS):
        torch.testing.assert_close(rows[0][:, j * H:(j + 1) * H], outs[i][0, -3:],
                                   atol=1e-4, rtol=1e-4)
    _, one = engine.forward_features([engine.new_cache()], [seq], [3], layers=(1,))
    assert torch.equal(one[0], torch.cat([rows[0][:, H:2 * H], plain[0]], 1))


def test_a_pass_over_pieces_asking_different_layers(tiny_models):
    """The target's pass taps the union of what its pieces ask; each piece gets its own
    layers' columns (``layer_columns``), exactly what it gets alone."""
    from specdec.serving.scheduler import layer_columns

    _, engine = _engine(tiny_models)
    a, b = torch.tensor([1, 520, 3300, 12, 99]), torch.tensor([7, 8, 41, 5, 6, 2])
    _, both = engine.forward_features([engine.new_cache(), engine.new_cache()], [a, b], [2, 2],
                                      [2, 3], layers=LAYERS)
    _, alone_a = engine.forward_features([engine.new_cache()], [a], [2], [2], layers=(1,))
    _, alone_b = engine.forward_features([engine.new_cache()], [b], [2], [3], layers=())
    got_a, got_b = layer_columns(both[0], LAYERS, (1,)), layer_columns(both[1], LAYERS, ())
    torch.testing.assert_close(got_a, alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_b, alone_b[0], atol=1e-5, rtol=1e-5)
    assert got_a.shape == (2, 2 * H) and got_b.shape == (3, H)
    assert layer_columns(both[0], LAYERS, LAYERS) is both[0]


def _verify(stub, sid, tokens, **kw):
    return stub.Verify(pb.VerifyRequest(session=pb.SessionRef(session_id=sid), tokens=tokens,
                                        **kw), timeout=30)


def test_the_target_returns_the_layers_asked_and_refuses_bad_ones(tservices, tiny_models):
    """VerifyRequest.feature_layers: rows of dim (1 + layers) * hidden, the final feature last
    and equal to an unlayered call's; each layer's rows the engine's, in float16. Layers out
    of range, unordered, or without return_features: INVALID_ARGUMENT naming the fault, and
    the service goes on."""
    _, engine = _engine(tiny_models)
    tokens = [1, 520, 3300, 12, 99, 7]
    with grpc.insecure_channel(tservices["target"].address) as ch:
        stub = pb_grpc.TargetServiceStub(ch)
        plain = _verify(stub, "fl-plain", tokens, return_features=True, features_from=3)
        r = _verify(stub, "fl", tokens, return_features=True, features_from=3,
                    feature_layers=[0, 1])
        assert r.features.dim == 3 * H and r.features.start == 3
        rows = torch.frombuffer(bytearray(r.features.data), dtype=torch.float16).view(-1, 3 * H)
        flat = torch.frombuffer(bytearray(plain.features.data), dtype=torch.float16).view(-1, H)
        assert rows.shape[0] == 3 and torch.equal(rows[:, 2 * H:], flat)
        _, ref = engine.forward_features([engine.new_cache()], [torch.tensor(tokens)], [3],
                                         layers=LAYERS)
        torch.testing.assert_close(rows.float(), ref[0].half().float(), atol=2e-3, rtol=2e-3)
        assert r.next_token == plain.next_token
        for bad, says in (([2], "the target has 2 layers"), ([1, 0], "distinct and ascending"),
                          ([0, 0], "distinct and ascending")):
            with pytest.raises(grpc.RpcError) as err:
                _verify(stub, "fl-bad", tokens, return_features=True, feature_layers=bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            _verify(stub, "fl-bad", tokens, feature_layers=[0])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "set return_features" in err.value.details()
        assert _verify(stub, "fl-after", tokens).next_token == plain.next_token
        for sid in ("fl-plain", "fl", "fl-bad", "fl-after"):
            stub.CloseSession(pb.CloseRequest(session_id=sid), timeout=30)


def test_saturating_float16_keeps_huge_residuals_finite():
    """A residual beyond float16's range (some models' middle layers) saturates at +-65504
    on the wire and in the data, instead of becoming inf, which the draft would refuse."""
    from specdec.serving.feature_engine import half_features

    got = half_features(torch.tensor([[1e6, -7e4, 3.0]]))
    assert got.tolist() == [[65504.0, -65504.0, 3.0]]
    assert not torch.isfinite(torch.tensor([[1e6]]).half()).all()  # what plain .half() gives


# -- the draft's input ------------------------------------------------------------------------


def test_a_predicted_row_reads_the_layers_as_their_means(tiny_models):
    """A row on the draft's own predicted feature (the rest of a block, the speculation
    cache's branches) reads the layers' rows as their means: the same input as the target's
    rows [tap_mean; prediction]; the final feature alone is read over its scale."""
    draft = tapped_draft(tiny_models["target"])
    pred, tok = torch.randn(2, 5, H), torch.randint(0, 49152, (2, 5))
    as_means = torch.cat([draft.tap_mean.flatten().expand(2, 5, -1), pred], -1)
    assert torch.allclose(draft.rows(pred, tok), draft.rows(as_means, tok), atol=1e-5)
    zeros = torch.cat([torch.zeros(2, 5, 2 * H), pred], -1)  # the mutant: raw zeros
    assert not torch.allclose(draft.rows(pred, tok), draft.rows(zeros, tok), atol=1e-3)
    read = fm.read_features(as_means, 1.3, draft.tap_mean, draft.tap_std)
    assert torch.allclose(read[..., 2 * H:], pred / 1.3) and read[..., :2 * H].abs().max() < 1e-6


def test_the_draft_file_keeps_the_layers_and_their_statistics(tiny_models, tapped_dir):
    """save -> load: the layers, and tap_mean / tap_std exactly (float16 numbers, as
    training rounds them); a served draft tells the orchestrator its width and layers, and
    the pair check takes the layers into the width."""
    from orchestrator.pair import FeatureMismatch, check_pair

    original, loaded = tapped_draft(tiny_models["target"]), fm.load_draft(tapped_dir)
    assert loaded.feature_layers == LAYERS and loaded.feature_width == 3 * H
    assert torch.equal(loaded.tap_mean, original.tap_mean)
    assert torch.equal(loaded.tap_std, original.tap_std)
    engine = FeatureEngine.load(tapped_dir)
    assert engine.feature_layers == LAYERS and engine.feature_width == 3 * H
    target = pb.ModelInfo(model="t", tokenizer_fingerprint="x", feature_dim=H)
    check_pair(target, pb.ModelInfo(model="d", tokenizer_fingerprint="x", features=True,
                                    feature_dim=3 * H, feature_layers=[0, 1]))
    with pytest.raises(FeatureMismatch, match="layers \\[0\\]"):
        check_pair(target, pb.ModelInfo(model="d", tokenizer_fingerprint="x", features=True,
                                        feature_dim=3 * H, feature_layers=[0]))


def test_engine_rows_are_the_models_rows_on_target_and_predicted_features(tapped_dir):
    """Served rows on the target's layered features are the module's teacher-forced rows;
    the next row, on the draft's own prediction, is the row a cache gets when sent
    [tap_mean; that prediction] as the target's features there."""
    draft = fm.load_draft(tapped_dir)
    engine = FeatureEngine.from_module(draft, numerics="float")
    tokens = torch.randint(0, 49152, (20,))
    feats = torch.randn(20, 3 * H) * 3
    s = 5
    cache = engine.new_cache()
    cache.add_features(s, feats[s:15])
    engine.forward([cache], [tokens[:10]], [0])
    got = engine.forward([cache], [tokens[10:16]], [6])[0]  # positions 10..15
    ref = draft(feats[None, s:15], tokens[None, s + 1:16])[0][0][0]
    assert torch.allclose(got, ref[-6:], atol=1e-4)

    nxt = engine.forward([cache], [tokens[16:17]], [1])[0]  # row 16 reads row 15's prediction
    means = torch.cat([draft.tap_mean.flatten(), cache.preds[15 - s - 1]])[None]
    fresh = engine.new_cache()
    fresh.add_features(s, torch.cat([feats[s:15], means]))
    assert torch.allclose(engine.forward([fresh], [tokens[:17]], [1])[0], nxt, atol=1e-4)


# -- data and training ------------------------------------------------------------------------


def test_data_keeps_the_layers_and_training_reads_them(tiny_models, tmp_path):
    """``write_shards(feature_layers=...)`` records hold ``taps`` beside the same final
    ``features``; ``FeatureExamples`` reads [taps; final] and regresses the final feature
    only; a draft asking for layers the data lacks is refused, naming the command."""
    from specdec.distill import feature_draft as fd
    from specdec.distill.data import load_shards, write_shards
    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import eos_token_ids

    _, engine = _engine(tiny_models)
    tok = load_tokenizer(tiny_models["target"])
    convs = [[{"role": "user", "content": "Say something about rivers."}],
             [{"role": "user", "content": "Count to five."}]]
    eos = set(eos_token_ids(tok, None))
    kw = dict(max_new_tokens=10, batch_size=2, temperatures=(0.0,), prompts_per_shard=2,
              features=True)
    plain = load_shards(write_shards(engine, tok, convs, tmp_path / "plain", eos, **kw))
    tapped = load_shards(write_shards(engine, tok, convs, tmp_path / "tapped", eos,
                                      feature_layers=(1,), **kw))
    for p, t in zip(plain, tapped):
        assert torch.equal(p["answer"], t["answer"])
        torch.testing.assert_close(p["features"], t["features"], atol=2e-3, rtol=2e-3)
        assert t["taps"].shape == (len(t["answer"]), 1, H) and t["tap_layers"].tolist() == [1]
    vocab_map = torch.arange(4096)
    ex = fd.FeatureExamples(vocab_map, 49152, feature_layers=(1,))
    ex.add(tapped)
    b = ex.batch([0, 1])
    a = len(tapped[0]["answer"])
    assert b["features"].shape[-1] == 2 * H
    assert torch.equal(b["features"][0, :a, :H], tapped[0]["taps"][:, 0].float())
    assert torch.equal(b["next_features"][0, : a - 1], tapped[0]["features"][1:].float())
    mean, std = fd.tap_stats(tapped, (1,))
    assert mean.shape == std.shape == (1, H) and torch.equal(mean, mean.half().float())
    with pytest.raises(ValueError, match="--feature-layers 0"):
        fd.FeatureExamples(vocab_map, 49152, feature_layers=(0,)).add(tapped)


# -- served ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["spec", "pipelined"])
def test_every_mode_gives_the_targets_text_with_a_layered_draft(tservices, mode):
    """Greedy: identical to target-only; coupled sampling: identical for the same seed; the
    draft proposed and never failed (it would, were its features of another width)."""
    for prompt in TOKEN_PROMPTS[:2]:
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=7)):
            ref = asyncio.run(generate_on(tservices, None, prompt, "target-only", 0,
                                          sampling=sampling))
            got = asyncio.run(generate_on(tservices, "tdraft", prompt, mode, 2,
                                          sampling=sampling))
            assert got.token_ids == ref.token_ids, (prompt, sampling)
            assert got.stats.draft_failures == 0 and got.stats.num_drafts > 0


def test_the_layers_reach_the_draft_exactly(tservices, tiny_models):
    """Mid-generation the draft's session holds, from the prompt's last position on, rows of
    [layer 0; layer 1; final feature]: the float16 of the target engine's rows."""
    prompt = TOKEN_PROMPTS[1]
    seen = {}
    service = tservices["tdraft"]

    async def look(n):
        if n == 8:
            (s,) = service.runtime.store._sessions.values()
            seen.update(tokens=list(s.cache.tokens), start=s.cache.feat_start,
                        feats=s.cache.feats.clone())

    got = asyncio.run(generate_on(tservices, "tdraft", prompt, "spec", 2, max_new=30, hook=look))
    assert got.stats.draft_failures == 0 and seen["start"] == len(prompt) - 1
    n = seen["feats"].shape[0]
    assert n >= 5 and seen["feats"].shape[1] == 3 * H
    info = service.runtime.info  # what GetInfo tells the orchestrator, which asks the target
    assert info.features and info.feature_dim == 3 * H and list(info.feature_layers) == [0, 1]
    _, engine = _engine(tiny_models)
    _, ref = engine.forward_features([engine.new_cache()], [torch.tensor(seen["tokens"])],
                                     [len(seen["tokens"])], layers=LAYERS)
    ref = ref[0][seen["start"]:seen["start"] + n].half().float()
    torch.testing.assert_close(seen["feats"], ref, rtol=2e-3, atol=1e-3)


@pytest.mark.real
def test_the_wire_cost_bench_asks_for_the_drafts_layers():
    """``python -m bench.feature_wire --feature-layers 2,14`` (the default target's services)
    times verifies that ask for the draft's layers: rows of three times the hidden size."""
    from bench import feature_wire

    got = feature_wire.main(["--calls", "2", "--feature-layers", "2,14"])
    assert got["feature_layers"] == [2, 14] and got["feature_dim"] == 3 * 576
    assert got["verify_response_bytes"]["with"] > 3 * 2 * 576


@pytest.mark.real
def test_the_whole_stack_call_tapped_in_ranges_is_the_layer_by_layer_path():
    """On the default target (integer numerics, every layer in one native call) a tapped
    pass runs one call per range of layers: its layers' rows are the layer-by-layer path's
    bit for bit, and its final features and logits an untapped pass's, for 1, 3 and 40 rows
    after a cached context (each range reads its own layers' keys and values)."""
    from specdec.models.loading import load_engine

    engine, _, _ = load_engine("default", torch.device("cpu"))
    if engine.native is None or not engine._whole_stack(3):
        pytest.skip("the whole-stack call runs on specdec's native kernels")
    context = torch.arange(1000, 1040)

    def run(rows, layers, whole=True):
        engine.whole_stack = whole
        try:
            cache = engine.new_cache()
            engine.forward([cache], [context], [1])
            return engine.forward_features([cache], [torch.arange(5, 5 + rows)], [rows], [rows],
                                           layers=layers)
        finally:
            engine.whole_stack = True

    for rows in (1, 3, 40):
        logits, tapped = run(rows, (2, 14))
        plain_logits, plain = run(rows, ())
        _, by_layer = run(rows, (2, 14), whole=False)
        assert torch.equal(tapped[0], by_layer[0]), rows
        assert torch.equal(tapped[0][:, 2 * 576:], plain[0])
        assert torch.equal(logits[0], plain_logits[0])
