"""The ragged engine computes what transformers computes, alone or batched, with rollback."""

import pytest
import torch

from specdec.models.hub import load_hf_model
from specdec.serving.engine import LlamaEngine
from specdec.serving.kernels import smallm_available


@pytest.fixture(scope="module")
def tiny(tiny_models):
    model, tok = load_hf_model(tiny_models["target"])
    return model, LlamaEngine.from_hf(model, kernels="onednn"), LlamaEngine.from_hf(model, kernels="mkl")


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("which", [1, 2])
def test_prefill_and_steps_match_transformers(tiny, which):
    model, engine = tiny[0], tiny[which]
    ids = list(range(100, 140))
    ref = hf_logits(model, ids)  # [40, vocab]
    cache = engine.new_cache()
    out = engine.forward([cache], [torch.tensor(ids[:30])], [30])[0]
    torch.testing.assert_close(out, ref[:30], atol=2e-4, rtol=1e-3)
    for i in range(30, 40):  # one token at a time, against the cache
        step = engine.forward([cache], [torch.tensor([ids[i]])], [1])[0]
        torch.testing.assert_close(step[0], ref[i], atol=2e-4, rtol=1e-3)
    assert cache.length == 40


def test_features_are_the_final_norms_output_the_head_reads(tiny):
    """forward_features: with each session's logits, the rows the head read them from (the
    target's feature of a position, what a feature-conditioned draft is given): transformers'
    last hidden state (after the final norm) at those positions."""
    model, engine = tiny[0], tiny[1]
    seqs = [list(range(100, 130)), list(range(7, 12))]
    caches = [engine.new_cache() for _ in seqs]
    logits, feats = engine.forward_features(caches, [torch.tensor(s) for s in seqs], [3, 1])
    for ids, lg, ft, n in zip(seqs, logits, feats, (3, 1)):
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        assert ft.shape == (n, model.config.hidden_size)
        torch.testing.assert_close(ft, hidden[-n:], atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(engine.head(ft).float(), lg)


def test_ragged_batch_equals_each_session_alone(tiny):
    engine = tiny[1]
    seqs = [list(range(5, 25)), list(range(300, 307)), [42]]
    news = [[7, 8, 9], [11], [12, 13, 14, 15, 16]]
    solo = []
    for s, n in zip(seqs, news):
        c = engine.new_cache()
        engine.forward([c], [torch.tensor(s)], [1])
        solo.append(engine.forward([c], [torch.tensor(n)], [len(n)])[0])
    caches = [engine.new_cache() for _ in seqs]
    engine.forward(caches, [torch.tensor(s) for s in seqs], [1, 1, 1])
    batched = engine.forward(caches, [torch.tensor(n) for n in news], [len(n) for n in news])
    for a, b in zip(solo, batched):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_truncate_rolls_back_exactly(tiny):
    engine = tiny[1]
    c = engine.new_cache()
    engine.forward([c], [torch.tensor(list(range(50, 70)))], [1])
    first = engine.forward([c], [torch.tensor([1, 2, 3])], [3])[0]
    c.truncate(20)  # drop the 3 tokens, as a rejected block is dropped
    engine.forward([c], [torch.tensor([9, 9])], [2])
    c.truncate(20)
    again = engine.forward([c], [torch.tensor([1, 2, 3])], [3])[0]
    torch.testing.assert_close(first, again, atol=1e-5, rtol=1e-5)


def test_cache_grows_and_refuses_past_the_context(tiny):
    engine = tiny[1]
    c = engine.new_cache()
    engine.forward([c], [torch.arange(200)], [0])
    assert c.capacity >= 200 and c.nbytes > 0
    with pytest.raises(ValueError, match="exceeds the model's context"):
        c.ensure(engine.arch.max_context + 1)


def test_unsupported_architecture_is_refused():
    from types import SimpleNamespace

    from specdec.serving.arch import ArchConfig

    with pytest.raises(ValueError, match="not supported"):
        ArchConfig.from_hf(SimpleNamespace(model_type="gpt2"))


@pytest.mark.real
@pytest.mark.parametrize("kernels", ["auto", "onednn", "mkl", "mkl-t"] + (
    ["smallm"] if smallm_available(torch.device("cpu")) else []))
def test_a_block_pass_agrees_with_one_token_passes_within_the_stated_bound(kernels):
    """The README's greedy guarantee: row j of a (k+1)-token verify pass and a 1-token pass at
    the same position differ only by fp32 rounding (bound 2e-4 on the default target's
    logits; measured up to ~6e-5), so tokens can differ only where two logits are that close."""
    from specdec.models.loading import load_engine

    engine, _, _ = load_engine("default", torch.device("cpu"), kernels, "float")
    prompt = torch.arange(120) % 5000 + 100
    block = torch.tensor([504, 3575, 282, 4649, 314])
    ctx = engine.new_cache()
    engine.forward([ctx], [prompt], [1])
    rows = engine.forward([ctx], [block], [len(block)])[0]  # [5, vocab], one verify pass
    ctx.truncate(len(prompt))
    for j, tok in enumerate(block):
        one = engine.forward([ctx], [tok[None]], [1])[0][0]  # the same position, alone
        diff = float((one - rows[j]).abs().max())
        assert diff < 2e-4, (kernels, j, diff)
        assert int(one.argmax()) == int(rows[j].argmax()) or \
            float(one.topk(2).values.diff().abs()) < 4e-4


def test_an_int8_engine_is_the_model_with_its_linear_weights_quantized(tiny):
    """quantize="int8": every linear layer (attention, MLP, head) runs its int8 weight, and
    nothing else changes (embeddings, norms in float): the engine's logits are those of an
    fp32 engine over the dequantized weights, and near the model's own."""
    from specdec.serving.arch import ArchConfig, canonical_weights

    model = tiny[0]
    arch = ArchConfig.from_hf(model.config)
    weights = canonical_weights(model.state_dict(), arch)
    quantized = ("wqkv", "wo", "w_gate_up", "w_down", "head")

    def dequantized(w):
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        return torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]

    deq = {name: dequantized(w.float()) if name.split(".")[-1] in quantized else w
           for name, w in weights.items()}
    int8 = LlamaEngine(arch, weights, quantize="int8")
    ref = LlamaEngine(arch, deq, kernels="mkl")
    ids = [list(range(100, 130)), list(range(7, 12))]
    outs = []
    for engine in (int8, ref, tiny[2]):
        caches = [engine.new_cache() for _ in ids]
        outs.append(engine.forward(caches, [torch.tensor(i) for i in ids], [4, 2]))
    for q, r, fp in zip(*outs):
        torch.testing.assert_close(q, r, atol=1e-4, rtol=1e-4)
        assert (q - fp).abs().max() > 1e-4  # a quantized model, not the fp32 one
        assert (q.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.5
    with pytest.raises(ValueError, match="quantize must be one of int8"):
        LlamaEngine(arch, weights, quantize="int4")


def test_int8_specs_name_a_draft_and_a_target_refuses_them():
    from specdec.config import ServiceConfig, split_quantization
    from specdec.models import draft_model
    from specdec.models.loading import resolve_draft_spec

    assert split_quantization("int8:default") == ("int8", "default")
    assert split_quantization("/models/a:b") == (None, "/models/a:b")
    assert split_quantization("default") == (None, "default")
    with pytest.raises(ValueError, match="needs a model spec after it"):
        split_quantization("int8:")
    shipped = draft_model.shipped_draft_dir()
    if shipped is not None:
        assert resolve_draft_spec("int8:default-draft", "default") == f"int8:{shipped}"
    assert resolve_draft_spec("int8:default", "default") == "int8:default"
    assert ServiceConfig(model="int8:default", role="draft").model == "int8:default"
    with pytest.raises(ValueError, match="can be a draft, not a target"):
        ServiceConfig(model="int8:default", role="target")


def test_default_draft_for_a_target_without_a_shipped_one_is_its_int8_copy(tiny_models):
    from specdec.models.loading import resolve_draft_spec

    other = tiny_models["target"]
    assert resolve_draft_spec("default-draft", other) == f"int8:{other}"
    assert resolve_draft_spec("ngram", other) == "ngram"


def test_distillation_answers_keep_the_feature_that_predicted_each_token(tiny):
    """specdec.distill.data with features: answer token i was the argmax of the head over
    feature i (greedy), the last prompt position's feature first."""
    from specdec.config import SamplingParams
    from specdec.distill.data import generate_answers

    engine = tiny[1]
    jobs = [(list(range(100, 120)), SamplingParams()), (list(range(5, 9)), SamplingParams())]
    for seq in generate_answers(engine, jobs, set(), 6, 2, 4, features=True):
        feats = torch.stack(seq.features).float()
        assert feats.shape == (6, engine.embed.shape[1])
        assert engine.head(feats).argmax(-1).tolist() == seq.tokens
