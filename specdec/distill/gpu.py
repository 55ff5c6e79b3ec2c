"""Build a draft with far more data on a GPU, in one short, time-boxed run.

``specdec distill`` on this project's 2-core CPU makes about 120 target tokens per second of
training data, and the draft's held-out acceptance is limited by data (docs/draft.md). On a GPU
the target answers thousands of prompts at once, so one run of a few minutes buys millions of
on-policy tokens. Three steps, so the GPU machine needs only PyTorch, transformers and gguf:

1. ``prepare`` (anywhere): tokenize the training prompts with the target's chat template and
   take the target's greedy answers to the held-out prompts (for early stopping);
2. ``run`` (on the GPU): the target answers every prompt greedily and sampled, in large
   left-padded batches with a KV cache, keeping its top-32 log-probs per token, until the data
   budget (seconds) is spent; then the draft trains on it (same recipe, loss and model as
   ``specdec distill``) for the training budget, keeping the weights that score best on the
   held-out set; the weights are written as fp16;
3. ``finish`` (anywhere): write the draft directory (int8, embedding left to the target) and
   evaluate it on the held-out set on this machine.

    python -m specdec.distill.gpu prepare --out runs/d3
    python -m specdec.distill.gpu run --out runs/d3 --target PATH.gguf   # on the GPU
    python -m specdec.distill.gpu finish --out runs/d3

The target runs in float32 with TF32 off, so its argmax and log-probs are the ones the CPU
computes, up to summation order.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import pathlib
import random
import sys
import time

import torch
from tqdm import tqdm

from specdec.distill import train as distill
from specdec.models.feature_model import parse_layers

log = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.pt"
HELD_OUT_FILE = "heldout.pt"
WEIGHT_FILES = ("weights-layers.pt", "weights-head.pt")
RESULT_FILE = "gpu-card.json"
FEATURE_FILE = "feature-draft.pt"  # a feature draft's weights, vocabulary and recipe (run)
FEATURE = "feature"  # run --kind: the feature-conditioned draft


# -- 1. prepare -------------------------------------------------------------------------------


def prepare(out: pathlib.Path, target: str, n_prompts: int, prompt_set: str,
            heldout_prompts: int, max_new_tokens: int, seed: int) -> None:
    from transformers import AutoConfig

    from specdec.distill.cli import held_out_records
    from specdec.distill.prompts import train_conversations
    from specdec.models.hub import load_tokenizer, resolve_model_dir
    from specdec.models.tokenizer import chat_prompt_ids, eos_token_ids

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(target)
    config = AutoConfig.from_pretrained(resolve_model_dir(target))
    convs = train_conversations(n_prompts, seed=seed, prompt_set=prompt_set)
    prompts = [torch.tensor(chat_prompt_ids(tokenizer, c), dtype=torch.int32)
               for c in tqdm(convs, desc="tokenizing prompts", unit="prompt")]
    torch.save({"tokens": torch.cat(prompts), "lengths": torch.tensor([len(x) for x in prompts]),
                "eos": eos_token_ids(tokenizer, config),
                "pad": int(tokenizer.pad_token_id or 0), "prompt_set": prompt_set,
                "n_prompts": n_prompts, "seed": seed, "target": target}, out / PROMPTS_FILE)
    held = held_out_records(target, out, heldout_prompts, max_new_tokens)
    torch.save(held, out / HELD_OUT_FILE)
    print(f"{len(prompts)} prompts and {sum(len(r['answer']) for r in held)} held-out tokens "
          f"written to {out}")


# -- 2. run (GPU) -----------------------------------------------------------------------------


@contextlib.contextmanager
def tapped(model, layers: tuple[int, ...]):
    """{layer: its output at each row's last position}, filled by every forward while open
    (hooks on those decoder layers: the residual stream after each)."""
    taps: dict[int, torch.Tensor] = {}

    def tap(li):
        def hook(_module, _args, out):
            taps[li] = (out[0] if isinstance(out, tuple) else out)[:, -1]
        return hook

    hooks = [model.model.layers[li].register_forward_hook(tap(li)) for li in layers]
    try:
        yield taps
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def answer_batch(model, prompts: list[torch.Tensor], temps: torch.Tensor, eos: list[int], pad: int,
                 max_new: int, top_n: int, gen: torch.Generator, features: bool = False,
                 feature_layers: tuple[int, ...] = ()) -> list[dict]:
    """The target's answers to a batch of prompts (left-padded), with top-N log-probs and,
    with ``features``, the final norm's output at the position that predicted each answer
    token (what its head read: a feature draft's input, as ``LlamaEngine.forward_features``
    gives it), after the residual stream of ``feature_layers`` there (``tapped``;
    ``data.feature_record`` makes the record's keys)."""
    with tapped(model, feature_layers if features else ()) as taps:
        return _answer_batch(model, prompts, temps, eos, pad, max_new, top_n, gen, features,
                             feature_layers, taps)


def _answer_batch(model, prompts, temps, eos, pad, max_new, top_n, gen, features,
                  feature_layers, taps) -> list[dict]:
    from transformers import DynamicCache

    from specdec.distill.data import feature_record
    from specdec.serving.feature_engine import half_features

    if features and getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("features: a head with soft-capped logits is not supported")

    def forward(**kw):  # (last logits, last feature rows or None)
        if not features:
            return model(**kw, use_cache=True, logits_to_keep=1).logits[:, -1], None
        h = model.model(**kw, use_cache=True).last_hidden_state[:, -1]
        return model.lm_head(h), torch.cat([*(taps[li] for li in feature_layers), h], -1)

    device = temps.device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = p.long()
        mask[r, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    eos_t = torch.tensor(eos, device=device)
    cache = DynamicCache()
    logits, h = forward(input_ids=ids, attention_mask=mask, position_ids=pos,
                        past_key_values=cache)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    toks, top_i, top_v, feats = [], [], [], []
    for _ in range(max_new):
        if features:
            feats.append(half_features(h))  # (as the wire carries them)
        logp = logits.float().log_softmax(-1)
        tv, ti = logp.topk(top_n)
        probs = torch.softmax(logits.float() / temps.clamp_min(1e-4)[:, None], -1)
        sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
        nxt = torch.where(temps > 0, sampled, ti[:, 0])
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        toks.append(nxt)
        top_i.append(ti.to(torch.int32))
        top_v.append(tv.to(torch.float16))
        lengths += (~done).long()
        done = done | torch.isin(nxt, eos_t)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=device)], 1)
        pos = pos[:, -1:] + 1
        logits, h = forward(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                            past_key_values=cache)
    toks_c = torch.stack(toks, 1).cpu()
    ti_c, tv_c = torch.stack(top_i, 1).cpu(), torch.stack(top_v, 1).cpu()
    feats_c = torch.stack(feats, 1).cpu() if features else None  # [b, answer, width]
    lengths = lengths.cpu()
    temps_c = temps.cpu()
    return [dict(prompt=prompts[r].to(torch.int32), answer=toks_c[r, : lengths[r]].to(torch.int32),
                 top_ids=ti_c[r, : lengths[r]].clone(), top_logprobs=tv_c[r, : lengths[r]].clone(),
                 temperature=float(temps_c[r]),
                 **(feature_record(feats_c[r, : lengths[r]], feature_layers,
                                   model.config.hidden_size) if features else {}))
            for r in range(b) if lengths[r] > 0]


def generate(model, prompts: list[torch.Tensor], temperatures: list[float], eos: list[int],
             pad: int, max_new: int, batch: int, top_n: int, budget_s: float, seed: int,
             device: torch.device, features: bool = False,
             feature_layers: tuple[int, ...] = ()) -> list[dict]:
    """Answers for prompts x temperatures, in shuffled batches of similar length, until the budget."""
    jobs = [(i, t) for i in range(len(prompts)) for t in temperatures]
    jobs.sort(key=lambda j: len(prompts[j[0]]))
    batches = [jobs[i : i + batch] for i in range(0, len(jobs), batch)]
    random.Random(seed).shuffle(batches)
    gen = torch.Generator(device=device).manual_seed(seed)
    records: list[dict] = []
    t0 = time.time()
    bar = tqdm(batches, desc="target answers", unit="batch")
    for part in bar:
        if time.time() - t0 > budget_s:
            log.info("data budget spent after %d of %d batches", len(records) // batch, len(batches))
            break
        temps = torch.tensor([t for _, t in part], dtype=torch.float32, device=device)
        got = answer_batch(model, [prompts[i] for i, _ in part], temps, eos, pad, max_new, top_n,
                           gen, features, feature_layers)
        for rec, (i, _) in zip(got, part):
            rec["conversation"] = i
        records.extend(got)
        n_tok = sum(len(r["answer"]) for r in records)
        bar.set_postfix(tokens=n_tok, tok_s=f"{n_tok / (time.time() - t0):.0f}")
    bar.close()
    return records


def _training_steps(module, train_steps, n_examples: int, batch: int, train_seconds: float,
                    max_epochs: float, n: int = 12) -> tuple[int, float, float]:
    """Size a run to its budget: ``train_steps(copy, steps)`` trains a throwaway copy of
    ``module`` for a few timed steps. Returns (steps: at least 20, seconds a step, epochs)."""
    probe = copy.deepcopy(module)
    train_steps(probe, n)  # first steps include warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.time()
    train_steps(probe, n)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    per_step = (time.time() - t0) / n
    epoch_steps = max(1, n_examples // batch)
    steps = max(20, int(min(train_seconds / per_step, max_epochs * epoch_steps)))
    return steps, per_step, steps / epoch_steps


def run(out: pathlib.Path, target: str, gen_seconds: float, train_seconds: float, batch: int,
        temperatures: list[float], max_new: int, recipe: distill.Recipe, max_epochs: float,
        eval_every: int, kind: str = "plain", feature_layers: tuple[int, ...] = ()) -> dict:
    """Data, then training: a plain draft (``distill``'s recipe), or with ``kind`` "feature"
    the feature-conditioned draft (``feature_draft``'s), its data keeping the target's
    features (1.1 KB a token on the default target: 4.4 GB for 3.87M tokens in host memory;
    an 8B target's 8 KB a token would need the data streamed to disk first), with
    ``feature_layers`` the residual after those layers too (as much again per layer)."""
    from specdec.models.hub import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t_start = time.time()
    data = torch.load(out / PROMPTS_FILE, weights_only=True)
    data["prompts"] = list(data["tokens"].split(data["lengths"].tolist()))
    held = torch.load(out / HELD_OUT_FILE, weights_only=True)
    model, _ = load_hf_model(target, device)
    vocab_size = int(model.config.vocab_size)
    t_loaded = time.time()
    records = generate(model, data["prompts"], temperatures, data["eos"], data["pad"], max_new,
                       batch, 32, gen_seconds, recipe.seed, device, features=kind == FEATURE,
                       feature_layers=feature_layers)
    t_data = time.time()
    n_tokens = sum(len(r["answer"]) for r in records)
    print(f"data: {len(records)} answers, {n_tokens} target tokens in {t_data - t_loaded:.0f} s "
          f"({n_tokens / max(t_data - t_loaded, 1e-9):.0f} tok/s)", flush=True)

    recipe = dataclasses.replace(recipe, target=target)
    torch.manual_seed(recipe.seed)
    vocab_map = distill.build_vocab(records, recipe.vocab, sorted(data["eos"]))
    if kind == FEATURE:
        figures, saved = _train_feature(model, records, vocab_map, recipe, train_seconds,
                                        max_epochs, device, feature_layers)
        torch.save(saved, out / FEATURE_FILE)
        card = {"kind": FEATURE, "recipe": saved["recipe"], "data": {}}
    else:
        examples = distill.Examples(records, vocab_map, vocab_size, recipe.max_len)
        held_ex = distill.Examples(held, vocab_map, vocab_size, recipe.max_len)
        module, arch = distill.init_from_target(recipe, vocab_map, model)  # no second load
        module.to(device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        steps, per_step, epochs = _training_steps(
            module, lambda m, n: distill.train(m, examples, dataclasses.replace(
                recipe, steps=n, warmup=1), None),
            len(examples), recipe.batch, train_seconds, max_epochs)
        recipe = dataclasses.replace(recipe, steps=steps)
        print(f"training: {steps} steps of {recipe.batch} ({per_step * 1000:.0f} ms/step, "
              f"{epochs:.2f} epochs)", flush=True)
        figures = distill.train(module, examples, recipe, None, held_ex, eval_every=eval_every)
        weights = {k: v.detach().cpu().to(torch.float16) for k, v in module.canonical().items()}
        torch.save({k: v for k, v in weights.items() if k.startswith("layers.")},
                   out / WEIGHT_FILES[0])
        torch.save({k: v for k, v in weights.items() if not k.startswith("layers.")}
                   | {"vocab_map": vocab_map.to(torch.int32)}, out / WEIGHT_FILES[1])
        card = {
            "recipe": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in vars(recipe).items()},
            "arch": dataclasses.asdict(arch),
            "data": {"vocab_coverage_train": round(distill.coverage(records, vocab_map), 4),
                     "vocab_coverage_held_out": round(distill.coverage(held, vocab_map), 4)},
        }
    t_train = time.time()
    card["data"] = {"answers": len(records), "target_tokens": n_tokens,
                    "prompts": len(data["prompts"]), "prompt_set": data["prompt_set"],
                    "temperatures": temperatures, "max_new_tokens": max_new, **card["data"]}
    card.update({
        "training": figures,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "run_command": "python -m specdec.distill.gpu " + " ".join(sys.argv[1:]),
        "time_s": {"load": round(t_loaded - t_start, 1), "data": round(t_data - t_loaded, 1),
                   "train": round(t_train - t_data, 1)},
    })
    (out / RESULT_FILE).write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card, indent=2), flush=True)
    return card


def _train_feature(model, records: list[dict], vocab_map: torch.Tensor, recipe: distill.Recipe,
                   train_seconds: float, max_epochs: float, device: torch.device,
                   feature_layers: tuple[int, ...] = ()) -> tuple[dict, dict]:
    """Train the feature draft on ``records`` (with features) on ``device`` for about
    ``train_seconds``: (figures, what ``finish`` makes the draft from)."""
    from specdec.distill import feature_draft as fd
    from specdec.models import feature_model as fm

    frecipe = fm.FeatureRecipe(target=recipe.target, vocab=recipe.vocab, batch=recipe.batch,
                               lr=recipe.lr, warmup=recipe.warmup, seed=recipe.seed,
                               feature_layers=",".join(map(str, feature_layers)))
    scale = fd.feature_rms(records)
    stats = fd.tap_stats(records, feature_layers) if feature_layers else None
    draft = fm.init_from_target(frecipe, vocab_map, scale, model=model, tap_stats=stats).to(device)
    examples = fd.FeatureExamples(vocab_map, int(model.config.vocab_size), frecipe.max_answer,
                                  feature_layers)
    examples.add(records)
    steps, per_step, epochs = _training_steps(
        draft, lambda m, n: fd.train(m, examples, dataclasses.replace(frecipe, steps=n, warmup=1),
                                     progress=False),
        len(examples), frecipe.batch, train_seconds, max_epochs)
    frecipe = dataclasses.replace(frecipe, steps=steps)
    print(f"feature draft: {steps} steps of {frecipe.batch} ({per_step * 1000:.0f} ms/step, "
          f"{epochs:.2f} epochs)", flush=True)
    figures = fd.train(draft, examples, frecipe)
    state = {k: v.detach().cpu().to(torch.float16) if v.is_floating_point() else v.cpu()
             for k, v in draft.state_dict().items()}
    return figures, {"model": state, "vocab_map": vocab_map.to(torch.int32),
                     "feature_scale": scale, "recipe": dataclasses.asdict(frecipe)}


# -- 3. finish --------------------------------------------------------------------------------


def finish(out: pathlib.Path, draft_out: pathlib.Path, target: str, command: str) -> dict:
    from specdec.models import draft_model
    from specdec.serving.arch import ArchConfig

    card = json.loads((out / RESULT_FILE).read_text())
    if card.get("kind") == FEATURE:
        return _finish_feature(out, draft_out, target, command, card)
    weights = {}
    for name in WEIGHT_FILES:
        weights.update(torch.load(out / name, weights_only=True))
    vocab_map = weights.pop("vocab_map").long()
    weights = {k: v.float() for k, v in weights.items()}
    arch = ArchConfig(**card["arch"])
    card["recipe"]["target"] = target
    card["command"] = command
    draft_model.save(draft_out, arch, weights, vocab_map, target, card)
    held = torch.load(out / HELD_OUT_FILE, weights_only=True)
    card["held_out"] = distill.evaluate(str(draft_out), held)
    draft_model.update_card(draft_out, card)
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["held_out"], indent=2))
    return card


def _finish_feature(out: pathlib.Path, draft_out: pathlib.Path, target: str, command: str,
                    card: dict) -> dict:
    """The feature draft's directory, and its held-out figures on this machine: the held-out
    answers scored by the target here for their features (``data.score_answers``)."""
    from specdec.distill import feature_draft as fd
    from specdec.distill.cli import _engine_and_tokenizer
    from specdec.distill.data import score_answers
    from specdec.models import feature_model as fm

    saved = torch.load(out / FEATURE_FILE, weights_only=True)
    recipe = fm.FeatureRecipe(**{**saved["recipe"], "target": target})
    vocab_map = saved["vocab_map"].long()
    draft = fm.init_from_target(recipe, vocab_map, float(saved["feature_scale"]),
                                tap_stats=(saved["model"]["tap_mean"].float(),
                                           saved["model"]["tap_std"].float())
                                if recipe.layers else None)
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in saved["model"].items()})
    card["recipe"]["target"] = target
    card["command"] = command
    fm.save_draft(draft_out, draft, target, card)
    engine, tokenizer, _ = _engine_and_tokenizer(target)
    held = score_answers(engine, torch.load(out / HELD_OUT_FILE, weights_only=True), 32, True,
                         feature_layers=recipe.layers)
    examples = fd.FeatureExamples(vocab_map, len(tokenizer), feature_layers=recipe.layers)
    examples.add(held)
    card["held_out"] = fd.evaluate(fm.load_draft(draft_out), examples)
    from specdec.models import draft_model

    draft_model.update_card(draft_out, card)
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["held_out"], indent=2))
    return card


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.distill.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("prepare", help="tokenize prompts, take the held-out answers")
    a.add_argument("--out", required=True)
    a.add_argument("--target", default="default")
    a.add_argument("--prompts", type=int, default=16000)
    a.add_argument("--prompt-set", default="wide", choices=["base", "wide", "real"])
    a.add_argument("--heldout-prompts", type=int, default=48)
    a.add_argument("--max-new-tokens", type=int, default=192)
    a.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="generate data and train (on a GPU)")
    r.add_argument("--out", required=True)
    r.add_argument("--target", default="default",
                   help="the target on this machine: default, a .gguf file or a model directory")
    r.add_argument("--gen-seconds", type=float, default=150)
    r.add_argument("--train-seconds", type=float, default=200)
    r.add_argument("--gen-batch", type=int, default=1024)
    r.add_argument("--temperatures", default="0,0.8,1.0")
    r.add_argument("--max-new-tokens", type=int, default=192)
    r.add_argument("--layers", default="0,29")
    r.add_argument("--vocab", type=int, default=8192)
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--max-epochs", type=float, default=4.0)
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--kind", default="plain", choices=["plain", FEATURE],
                   help="the draft to train: plain (the default) or the feature-conditioned "
                        "one (its data keeps the target's features)")
    r.add_argument("--feature-layers", default="",
                   help="with --kind feature: the draft reads the residual after these target "
                        "layers too (comma-separated, e.g. 2,14 on the default target)")
    f = sub.add_parser("finish", help="write the draft directory and evaluate it")
    f.add_argument("--out", required=True)
    f.add_argument("--draft-out", default=None)
    f.add_argument("--target", default="default")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = pathlib.Path(args.out)
    if args.step == "prepare":
        prepare(out, args.target, args.prompts, args.prompt_set, args.heldout_prompts,
                args.max_new_tokens, args.seed)
    elif args.step == "run":
        recipe = distill.Recipe(layers=tuple(int(x) for x in args.layers.split(",")),
                                vocab=args.vocab, batch=args.batch, lr=args.lr,
                                warmup=args.warmup, seed=args.seed)
        run(out, args.target, args.gen_seconds, args.train_seconds, args.gen_batch,
            [float(t) for t in args.temperatures.split(",")], args.max_new_tokens, recipe,
            args.max_epochs, args.eval_every, args.kind, parse_layers(args.feature_layers))
    else:
        finish(out, pathlib.Path(args.draft_out or out / "draft"), args.target,
               " ".join(["python -m specdec.distill.gpu"] + sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
