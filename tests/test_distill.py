"""`specdec distill` end to end on a tiny budget, and the n-gram drafter's proposals."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import TOKEN_PROMPTS, ServiceThread, generate_on, hf_greedy, run

from specdec.serving.drafting import lookup


def test_distill_end_to_end_makes_a_loadable_exact_draft(tmp_path, tiny_models, tiny_services):
    target = tiny_models["target"]
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "distill", "--target", target,
         "--out", str(tmp_path / "work"), "--prompts", "6", "--max-new-tokens", "16",
         "--temperatures", "0,1", "--gen-batch", "8", "--heldout-prompts", "2",
         "--layers", "0,1", "--vocab", "600", "--steps", "4", "--batch", "4", "--threads", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    draft_dir = tmp_path / "work" / "draft"
    meta = json.loads((draft_dir / "draft.json").read_text())
    card = meta["card"]
    assert card["data"]["answers"] == 12  # 6 prompts x 2 temperatures
    assert card["training"]["steps"] == 4
    held = card["held_out"]
    assert 0.0 <= held["greedy_acceptance"] <= 1.0 and held["held_out_tokens"] > 0
    assert set(held["tokens_per_round"]) == {str(k) for k in range(1, 9)}
    assert meta["vocab_out"] == 600
    # the file stores no input embedding: it is read from the target
    from safetensors import safe_open

    with safe_open(str(draft_dir / "weights.safetensors"), "pt") as f:
        assert "embed" not in f.keys() and "vocab_map" in f.keys()

    # resumable: a second run with the same work dir trains no further and rewrites the draft
    again = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "distill", "--target", target,
         "--out", str(tmp_path / "work"), "--skip-data", "--heldout-prompts", "2",
         "--max-new-tokens", "16", "--layers", "0,1", "--vocab", "600", "--steps", "4",
         "--batch", "4", "--threads", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert again.returncode == 0, again.stderr[-3000:]

    # eval-draft reports each held-out set it is given, the handwritten one too
    evaluated = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "eval-draft", "--draft", str(draft_dir),
         "--work", str(tmp_path / "work"), "--heldout-prompts", "2", "--max-new-tokens", "16",
         "--held-out", "templated,handwritten"],
        capture_output=True, text=True, timeout=900,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])
    assert set(report) == {"templated", "handwritten"}
    assert report["templated"]["held_out_tokens"] == held["held_out_tokens"]  # the same set
    assert report["handwritten"]["held_out_tokens"] > 0
    assert (tmp_path / "work" / "heldout-handwritten").is_dir()

    # --init-draft trains on from a draft: 0 steps give back its very weights (not the
    # target-layer start a fresh run makes), a few steps move them; its vocabulary stays
    from safetensors.torch import load_file

    def train_on(steps, name, *more):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "distill", "--target", target,
             "--out", str(tmp_path / "work"), "--skip-data", "--heldout-prompts", "2",
             "--max-new-tokens", "16", "--init-draft", str(draft_dir), "--steps", str(steps),
             "--batch", "4", "--lr", "1e-2", "--threads", "1",
             "--draft-out", str(tmp_path / name), *more],
            capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return load_file(str(tmp_path / name / "weights.safetensors"))

    start = load_file(str(draft_dir / "weights.safetensors"))
    same, moved = train_on(0, "same"), train_on(3, "moved")
    assert same.keys() == start.keys() == moved.keys()
    assert all(torch.equal(same[k], start[k]) for k in start)
    assert torch.equal(moved["vocab_map"], start["vocab_map"])
    assert not torch.equal(moved["layers.0.wqkv.int8"], start["layers.0.wqkv.int8"])

    # --grow: a layer from target layer 1 goes before the draft's last, its output projections
    # zero, the draft's own layers kept; --more-answers adds another answers directory's
    # answers (here the run's own again: 12 scored + 12 labelled by their tokens)
    grown = train_on(0, "grown", "--grow", "1", "--answers-as-labels",
                     "--more-answers", str(tmp_path / "work" / "answers"))
    card = json.loads((tmp_path / "grown" / "draft.json").read_text())["card"]
    assert card["data"]["answers"] == 24
    assert all(torch.equal(grown[k], start[k]) for k in start if k.startswith("layers.0."))
    assert all(torch.equal(grown[k.replace("layers.1.", "layers.2.")], start[k])
               for k in start if k.startswith("layers.1."))
    assert not grown["layers.1.wo.int8"].any() and not grown["layers.1.w_down.int8"].any()
    assert grown["layers.1.wqkv.int8"].any()

    # the distilled draft serves, and speculative greedy output stays the target's

    svc = ServiceThread("draft", str(draft_dir), target=target)
    try:
        services = dict(tiny_services, distilled=svc)
        for prompt in TOKEN_PROMPTS[:2]:
            result = run(generate_on(services, "distilled", prompt, "pipelined", 3, max_new=24))
            assert result.token_ids == hf_greedy(target, prompt, 24)
            assert result.stats.draft_tokens > 0
    finally:
        svc.stop()


@pytest.mark.parametrize("seed", range(20))
def test_ngram_proposals_are_exact_substrings_of_the_history(seed):
    import random

    rng = random.Random(seed)
    history = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]
    k = rng.randrange(1, 8)
    proposal = lookup(history, k, max_ngram=4)
    assert len(proposal) <= k
    if proposal:
        # some earlier occurrence of a history suffix is followed by exactly the proposal
        found = any(
            history[j : j + n] == history[-n:] and history[j + n : j + n + len(proposal)] == proposal
            for n in range(1, 5) for j in range(len(history) - n)
        )
        assert found
    else:
        assert history[-1] not in history[:-1]  # nothing to look up


@pytest.mark.parametrize("seed", range(30))
def test_ngram_lookup_takes_the_longest_suffix_at_its_latest_occurrence(seed):
    import random

    def reference(history, k, max_ngram, min_ngram):  # the definition, position by position
        for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
            for j in range(len(history) - n - 1, -1, -1):
                if history[j : j + n] == history[len(history) - n :]:
                    return history[j + n : j + n + k]
        return []

    rng = random.Random(seed)
    for _ in range(20):
        history = [rng.randrange(rng.choice([2, 4, 9])) for _ in range(rng.randrange(1, 80))]
        k, max_ngram = rng.randrange(1, 9), rng.randrange(1, 6)
        min_ngram = rng.randrange(1, max_ngram + 1)
        assert lookup(history, k, max_ngram, min_ngram) == \
            reference(history, k, max_ngram, min_ngram), (history, k, max_ngram, min_ngram)


def test_ngram_drafter_proposes_from_a_repetitive_prompt_and_stays_exact(tiny_services):

    prompt = [5, 6, 7, 8] * 10
    result = run(generate_on(tiny_services, "ngram", prompt, "spec", 4))
    assert result.stats.draft_tokens > 0  # the repeated prompt gives the lookup matches
    assert result.token_ids == hf_greedy(tiny_services["target"].config.model, prompt, 40)


def test_the_handwritten_held_out_prompts_are_no_templates_output():
    """The honest held-out set: no training (or templated held-out) template produces any of
    its prompts, with any topic."""
    import re

    from specdec.distill import prompts

    handwritten = [c[0]["content"] for c in prompts.held_out_set("handwritten")]
    assert len(handwritten) == len(set(handwritten)) == 48
    templates = (prompts.TEMPLATES + prompts.WIDE_TEMPLATES + prompts.HELD_OUT_TEMPLATES +
                 prompts.CODE_TASKS)
    patterns = [re.compile(re.escape(t).replace(re.escape("{t}"), ".+") + "$", re.S)
                for t in templates]
    assert patterns[0].match(prompts.TEMPLATES[0].format(t="glaciers"))  # the check can fail
    for p in handwritten:
        assert not any(pat.match(p) for pat in patterns), p
    training = {c[-1]["content"] for c in prompts.train_conversations(4000, prompt_set="wide")}
    assert not training & set(handwritten)
    with pytest.raises(ValueError, match="handwritten"):
        prompts.held_out_set("nope")


def test_the_real_prompt_set_is_half_real_text_and_never_a_held_out_prompt():
    """prompt_set="real": half the prompts wrap a passage, a function or a name from the
    standard library (bounded in length) in a task; none is or contains a handwritten one."""
    from specdec.distill import prompts, realtext

    src = realtext.sources()
    assert min(len(v) for v in src.values()) > 200  # the stdlib gives each kind plenty
    assert all(len(x) <= realtext.MAX_CHARS for x in src["text"] + src["code"])
    convs = prompts.train_conversations(400, seed=3, prompt_set="real")
    assert convs == prompts.train_conversations(400, seed=3, prompt_set="real")  # deterministic
    firsts = [c[-1]["content"] for c in convs]
    wide = [c[-1]["content"] for c in prompts.train_conversations(200, seed=3, prompt_set="wide")]
    real = realtext.real_text_prompts(200, seed=3)
    assert sorted(firsts) == sorted(wide + real)
    pool = src["text"] + src["code"] + src["name"]
    assert all(any(x in p for x in pool) for p in real)
    assert len(set(real)) > 190  # varied, not a few prompts repeated
    handwritten = [c[0]["content"] for c in prompts.held_out_set("handwritten")]
    for p in handwritten:
        assert not any(p in f or f in p for f in firsts), p


def test_kept_answers_rebuild_every_shard_by_scoring_with_the_same_scores(tmp_path, tiny_models):
    """The answers directory is all a new machine needs: with the shards gone, the same
    ``write_shards`` call rebuilds them by scoring the kept answers, and the records equal the
    generated ones (tokens exactly; log-probabilities and features to float rounding)."""
    import numpy as np
    import torch

    from specdec.distill.data import load_shards, write_shards
    from specdec.distill.prompts import train_conversations
    from specdec.models.loading import load_engine
    from specdec.models.tokenizer import eos_token_ids

    engine, tokenizer, config = load_engine(tiny_models["target"], torch.device("cpu"))
    eos = set(eos_token_ids(tokenizer, config))
    convs = train_conversations(5, prompt_set="base")
    identity = dict(target="tiny", prompts=5)

    def build(out):
        return write_shards(engine, tokenizer, convs, out, eos, max_new_tokens=12,
                            batch_size=4, top_n=8, temperatures=(0.0, 1.0), prompts_per_shard=2,
                            features=True, answers_dir=tmp_path / "answers", identity=identity)

    made = load_shards(build(tmp_path / "a"))
    kept = sorted((tmp_path / "answers").glob("answers-*.npz"))
    assert len(kept) == 3  # 5 prompts, 2 a shard
    size = sum(p.stat().st_size for p in kept)
    assert size < 8 * sum(len(r["prompt"]) + len(r["answer"]) for r in made)  # ids, no scores
    rebuilt = load_shards(build(tmp_path / "b"))  # no shard there: every one from answers
    assert len(rebuilt) == len(made) == 10
    for m, r in zip(made, rebuilt):
        assert torch.equal(m["prompt"], r["prompt"]) and torch.equal(m["answer"], r["answer"])
        assert m["temperature"] == r["temperature"] and m["conversation"] == r["conversation"]
        assert torch.equal(m["top_ids"][:, 0], r["top_ids"][:, 0])
        np.testing.assert_allclose(m["top_logprobs"].float(), r["top_logprobs"].float(),
                                   atol=2e-2)
        np.testing.assert_allclose(m["features"].float(), r["features"].float(), atol=2e-2)
    # answers made for another job list are refused, not mixed in
    identity["prompts"] = 6
    with pytest.raises(ValueError, match="answers made with"):
        build(tmp_path / "c")


@pytest.mark.parametrize("flags, message", [
    (["--answers-as-labels"], "--answers-as-labels goes with --skip-data"),
    (["--skip-data", "--more-answers", "x"], "--more-answers goes with --answers-as-labels"),
    (["--grow", "15"], "--grow goes with --init-draft")])
def test_distill_refuses_a_flag_without_the_one_it_needs_before_any_work(tmp_path, flags,
                                                                         message):
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "distill", "--out",
                          str(tmp_path / "work"), *flags], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and message in out.stderr
    assert not (tmp_path / "work").exists()  # refused before making anything


def test_a_grown_draft_starts_as_the_draft_it_grew_from(tiny_models):
    """grow_draft inserts target layers whose output projections are zero: the deeper draft's
    logits are the draft's exactly (mutant: the new layer's wo kept from the target), the new
    layer is the target's where it is not zero, and training moves it."""
    from transformers import AutoModelForCausalLM

    from specdec.distill import train as distill

    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"])
    recipe = distill.Recipe(target=tiny_models["target"], layers=(0,))
    vocab_map = torch.arange(600)
    draft, arch = distill.init_from_target(recipe, vocab_map, model=model)
    grown, grown_arch = distill.grow_draft(draft, (1,), model=model)
    assert (arch.num_layers, grown_arch.num_layers) == (1, 2)
    tokens = torch.randint(0, 600, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(grown(tokens), draft(tokens))
    new, old = grown.canonical(), draft.canonical()
    assert torch.equal(new["layers.1.w_down"], old["layers.0.w_down"])  # the draft's, last
    assert not new["layers.0.wo"].any() and new["layers.0.wqkv"].any()
    grown.train()
    grown(tokens).logsumexp(-1).mean().backward()
    assert grown.params["layers_0_wo"].grad.abs().sum() > 0


def test_unscored_answers_train_with_their_own_tokens_as_labels(tmp_path):
    """``--answers-as-labels``: the kept answers whose shard is not built become records whose
    one label per position is the answer's own token, so the distillation loss on them is the
    plain cross-entropy of those tokens (crafted logits), and only missing shards count."""
    import torch

    from specdec.distill import train as distill
    from specdec.distill.data import answers_as_labels, load_answers, save_answers, unscored_answers

    gen = torch.Generator().manual_seed(0)
    records = [dict(prompt=torch.randint(0, 50, (n_p,), generator=gen, dtype=torch.int32),
                    answer=torch.randint(0, 50, (n_a,), generator=gen, dtype=torch.int32),
                    temperature=t, conversation=i)
               for i, (n_p, n_a, t) in enumerate([(3, 5, 0.0), (4, 2, 0.8), (2, 6, 0.0)])]
    (tmp_path / "answers").mkdir()
    (tmp_path / "data").mkdir()
    for n in range(3):
        save_answers(records, tmp_path / "answers" / f"answers-{n:05d}.npz")
    (tmp_path / "data" / "shard-00001.pt").write_bytes(b"")  # shard 1 is built
    kept = unscored_answers(tmp_path / "answers", tmp_path / "data")
    assert [p.name for p in kept] == ["answers-00000.npz", "answers-00002.npz"]

    labelled = answers_as_labels(load_answers(kept[0]))
    vocab_map = torch.arange(50)
    ex = distill.Examples(labelled, vocab_map, 50, max_len=64)
    tokens, rows, tgt_ids, tgt_lp = ex.batch(list(range(len(ex))))
    logits = torch.randn(*tokens.shape, 50, generator=gen)
    loss, _ = distill.soft_target_loss(logits, rows, tgt_ids, tgt_lp)
    flat = logits.reshape(-1, 50)[rows]
    answers = torch.cat([r["answer"].long() for r in records])
    expected = torch.nn.functional.cross_entropy(flat, answers)
    assert torch.allclose(loss, expected, atol=1e-5)

    # in one batch with scored records (top-N columns): each keeps its own loss
    scored = [dict(r, top_ids=torch.randint(0, 50, (len(r["answer"]), 4), generator=gen,
                                            dtype=torch.int32),
                   top_logprobs=torch.randn(len(r["answer"]), 4, generator=gen).log_softmax(-1))
              for r in records]
    both = distill.Examples(labelled + scored, vocab_map, 50, max_len=64)
    tokens, rows, tgt_ids, tgt_lp = both.batch(list(range(len(both))))
    logits = torch.randn(*tokens.shape, 50, generator=gen)
    mixed, _ = distill.soft_target_loss(logits, rows, tgt_ids, tgt_lp)
    n = len(labelled)
    alone = [distill.soft_target_loss(logits[part], *distill.Examples(
        recs, vocab_map, 50, max_len=64).batch(list(range(len(recs))))[1:])[0]
        for part, recs in ((slice(0, n), labelled), (slice(n, None), scored))]
    n_lab = sum(len(r["answer"]) for r in labelled)
    n_sc = sum(len(r["answer"]) for r in scored)
    assert torch.allclose(mixed, (alone[0] * n_lab + alone[1] * n_sc) / (n_lab + n_sc), atol=1e-5)


def test_the_user_turn_prefix_is_the_template_up_to_a_users_message():
    """What the target continues to write a prompt is the chat template cut where a user
    message starts: a real message's template ids begin with it and go on with the message
    (with the template's default system message, and with one given)."""
    from specdec.distill.selfprompts import user_turn_prefix
    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import chat_prompt_ids

    tok = load_tokenizer("default")
    for system in (None, "You are terse."):
        prefix = user_turn_prefix(tok, system)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": "Where is Lyon?"}]
        ids = chat_prompt_ids(tok, messages)
        assert ids[:len(prefix)] == prefix
        assert tok.decode(ids[len(prefix):]).startswith("Where is Lyon?")
        assert tok.decode(prefix).endswith("user\n") and (system or "SmolLM") in tok.decode(prefix)


def test_a_written_prompt_is_kept_once_whole_and_never_a_held_out_one():
    """Only a turn the target ended is a prompt (mutant: keeping turns cut off at the token
    limit); a repeat (spacing and case aside), a held-out prompt, a too short or too long one
    is dropped."""
    from specdec.distill.selfprompts import finished_turn, keep
    from specdec.models.hub import load_tokenizer

    tok = load_tokenizer("default")
    ids, end = tok("How do I bake bread?")["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")
    assert finished_turn(tok, ids + [end], {end}) == "How do I bake bread?"
    assert finished_turn(tok, ids, {end}) is None and finished_turn(tok, [], {end}) is None

    seen: set[str] = set()
    held = {"what is the capital of france?"}
    assert keep("How do I bake bread at home?", seen, held)
    assert not keep("how do I  bake bread at HOME?", seen, held)  # the same, spaced and cased
    assert not keep("What is the capital of  France?", seen, held)  # held out
    assert not keep("Hi there", seen, held)  # too short to be a task
    assert not keep("x" * 900, seen, held)


def test_the_target_writes_its_own_prompts_resumably(tmp_path, monkeypatch):
    """The real default target writes user turns: each new, none a held-out prompt; a second,
    larger call keeps the first ones and adds the rest; a target that never ends a turn in
    time is an error, not an endless loop."""
    from specdec.distill import selfprompts
    from specdec.distill.cli import _engine_and_tokenizer, _self_conversations
    from specdec.distill.prompts import HELD_OUT_SETS, held_out_set

    monkeypatch.setattr(selfprompts, "CHUNK", 8)
    engine, tok, eos = _engine_and_tokenizer("default")
    path = tmp_path / "prompts.jsonl"
    first = _self_conversations(engine, tok, eos, 5, path, seed=0)
    texts = [c[0]["content"] for c in first]
    assert len(texts) == 5 == len(set(texts)) == len(path.read_text().splitlines())
    held = {m["content"] for name in HELD_OUT_SETS for c in held_out_set(name) for m in c}
    assert all(selfprompts.MIN_CHARS <= len(t) and t not in held for t in texts)
    more = _self_conversations(engine, tok, eos, 9, path, seed=0)
    assert [c[0]["content"] for c in more[:5]] == texts and len(more) == 9
    assert len({c[0]["content"] for c in more}) == 9
    monkeypatch.setattr(selfprompts, "MAX_PROMPT_TOKENS", 2)
    with pytest.raises(RuntimeError, match="no usable user turn"):
        _self_conversations(engine, tok, eos, 12, path, seed=0)
