"""A feature-conditioned draft (EAGLE-1 style, Li et al. 2024): prototype, training, evaluation.

The draft reads the target's *feature* (its final-RMSNorm output, what its head reads) as well
as tokens. Row t of the draft's context is

    x_t = fc([feature_t ; embed(token_{t+1})])

where feature_t is the target's feature at position t and token_{t+1} the token emitted there.
One Llama decoder layer (initialised from a target layer) runs over the rows of the answer so
far (the draft's context starts at the last prompt position: the target feature there already
carries the prompt), giving h_t; y_t = RMSNorm(h_t) serves twice:

* ``logits_t = head(y_t)`` over a reduced vocabulary predicts token_{t+2};
* ``y_t`` predicts feature_{t+1} (smooth-L1 regression), so that beyond the first drafted
  token the draft feeds its own predicted feature where the target's is not yet known. The
  norm starts as the target's final norm, so y is the same kind of vector as the target's
  features and the two losses agree (if y_t = feature_{t+1}, the logits are the target's).
  Regressing h_t instead (``feature_out="residual"``) measured worse: held-out step-1
  agreement 0.22 / 0.21 against 0.25 / 0.25 (templated / handwritten, 200 steps, 62k rows).

Data: the records of ``specdec.distill.data.write_shards(..., features=True)``, where
``features[i]`` is the target's feature at the position that predicted ``answer[i]``. Row i of
a record is (features[i], answer[i]) and its targets are the target's top-32 at answer[i+1] and
features[i+1].

Chains. Drafting k tokens from row c (true features up to c) runs "passes": pass 1 is row c
itself; pass s (s >= 2) is row c+s-1 with the feature y predicted by pass s-1 at row c+s-2 and the
draft's own token. Training and evaluation run every chain start at once with
``FeatureDraft.forward(passes=k)``: pass s's row t attends to the true rows <= t-s+1 and to the
rows t-s+u of passes u = 2..s (the chain's own earlier rows), exactly what ``step`` sees when a
server drafts token by token. With the target's tokens fed (teacher forcing) the chain's
agreement counts are those of greedy drafting, since a chain only counts while it agrees.

CLI (CPU; ``specdec distill-feature`` or ``python -m specdec.distill.feature_draft``)::

    specdec distill --out runs/eagle --data-only --features ...      # data with features
    specdec distill-feature heldout --out runs/eagle                # held-out answers
    specdec distill-feature train --data runs/eagle/data --out runs/eagle/f1 \
        --steps 1500 --heldout runs/eagle/heldout-templated-features
    specdec distill-feature eval --out runs/eagle/f1 \
        --heldout runs/eagle/heldout-templated-features runs/eagle/heldout-handwritten-features
    specdec distill-feature export --out runs/eagle/f1 --draft-out DIR
    specdec serve --draft DIR     # (or specdec serve-draft --model DIR)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.models.feature_model import (FeatureDraft, FeatureRecipe, init_from_target,
                                          parse_layers, save_draft)
from specdec.distill.train import (build_vocab, lr_at, save_checkpoint, simulate_tokens_per_round,
                                   soft_target_loss)

log = logging.getLogger(__name__)


# -- data -------------------------------------------------------------------------------------


def record_features(r: dict, layers: tuple[int, ...]) -> torch.Tensor:
    """A record's rows as the draft reads them: [answer, (len(layers) + 1) * hidden], the
    residual after each of ``layers`` (its ``taps``) then the final feature; ValueError
    naming the command when the record lacks a layer."""
    if not layers:
        return r["features"]
    have = tuple(r["tap_layers"].tolist()) if "tap_layers" in r else ()
    if not set(layers) <= set(have):
        raise ValueError(f"the draft reads target layers {layers}; the data holds "
                         f"{have or 'none'} (specdec distill --features "
                         f"--feature-layers {','.join(map(str, layers))})")
    taps = r["taps"][:, [have.index(x) for x in layers]]
    return torch.cat([taps.flatten(1), r["features"]], 1)


class FeatureExamples:
    """Records with features, as rows (feature_i, answer_i) -> targets at i + 1.

    With ``feature_layers`` a row's features are [taps of those layers; final feature]
    (records' ``taps`` [answer, layers, hidden], written with ``tap_layers`` by
    ``specdec distill --features --feature-layers``)."""

    def __init__(self, vocab_map: torch.Tensor, vocab_size: int, max_answer: int = 192,
                 feature_layers: tuple[int, ...] = ()):
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_draft[vocab_map] = torch.arange(len(vocab_map))
        self.max_answer = max_answer
        self.feature_layers = tuple(feature_layers)
        self.items: list[dict] = []

    def add(self, records: list[dict]) -> int:
        """Add records (those with >= 2 answer tokens); returns the number of rows added."""
        n = 0
        for r in records:
            a = min(len(r["answer"]), self.max_answer)
            if a < 2:
                continue
            self.items.append(dict(
                tokens=r["answer"][:a].long(),
                features=record_features(r, self.feature_layers)[:a].half(),
                top_ids=self.to_draft[r["top_ids"][1:a].long()], top_lp=r["top_logprobs"][1:a].half(),
            ))
            n += a - 1
        return n

    def __len__(self) -> int:
        return len(self.items)

    @property
    def rows(self) -> int:
        return sum(len(it["tokens"]) - 1 for it in self.items)

    def batch(self, idx: list[int]) -> dict:
        """Padded batch: features [b, t, width] float (width: the taps' and the final
        feature's), tokens [b, t], per-row targets at row r (r < len - 1): top_ids/top_lp
        [b, t, 32] (ids -1 = pad or outside the draft vocabulary), next_features [b, t,
        hidden] (the final feature of the row after), valid [b, t]."""
        items = [self.items[i] for i in idx]
        t = max(len(it["tokens"]) for it in items)
        width, top = items[0]["features"].shape[1], items[0]["top_ids"].shape[1]
        feats = torch.zeros(len(items), t, width)
        tokens = torch.zeros(len(items), t, dtype=torch.long)
        top_ids = torch.full((len(items), t, top), -1, dtype=torch.long)
        top_lp = torch.zeros(len(items), t, top)
        valid = torch.zeros(len(items), t, dtype=torch.bool)
        for b, it in enumerate(items):
            a = len(it["tokens"])
            feats[b, :a] = it["features"].float()
            tokens[b, :a] = it["tokens"]
            top_ids[b, : a - 1] = it["top_ids"]
            top_lp[b, : a - 1] = it["top_lp"].float()
            valid[b, : a - 1] = True
        final = feats[..., width - width // (len(self.feature_layers) + 1):]
        next_feats = torch.cat([final[:, 1:], torch.zeros_like(final[:, :1])], 1)
        return dict(features=feats, tokens=tokens, top_ids=top_ids, top_lp=top_lp,
                    next_features=next_feats, valid=valid)


def feature_rms(records: list[dict], n: int = 64) -> float:
    """RMS of the target's features (over the first ``n`` records)."""
    f = torch.cat([r["features"].float() for r in records[:n]])
    return float(f.pow(2).mean().sqrt())


def tap_stats(records: list[dict], layers: tuple[int, ...], n: int = 64
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and standard deviation [layers, hidden] of the target's residual at
    ``layers`` (over the first ``n`` records' answers), rounded to float16: what the draft
    file stores, so the served draft standardises with the numbers it was trained with."""
    rows = torch.cat([record_features(r, layers).float() for r in records[:n]])
    hidden = records[0]["features"].shape[1]
    taps = rows[:, : len(layers) * hidden].unflatten(1, (len(layers), hidden))
    return taps.mean(0).half().float(), (taps.std(0) + 1e-3).half().float()


def shard_paths(data_dir) -> list[pathlib.Path]:
    return sorted(pathlib.Path(data_dir).glob("shard-*.pt"))


def load_records(paths) -> list[dict]:
    out = []
    for p in paths:
        out.extend(torch.load(p, weights_only=True))
    return out


# -- training ---------------------------------------------------------------------------------


def to_device(batch: dict, draft: FeatureDraft) -> dict:
    """A batch on the draft's device (a GPU run trains there; the examples stay on the host)."""
    device = draft.fc.weight.device
    return batch if device.type == "cpu" else {k: v.to(device) for k, v in batch.items()}


def chain_losses(draft: FeatureDraft, batch: dict, recipe: FeatureRecipe, train: bool = True
                 ) -> tuple[torch.Tensor, list[dict]]:
    """Total loss over ``recipe.unroll`` passes and per-pass figures (ce, feature loss, top-1).

    Pass s is scored at rows r >= s - 1 (a chain needs its start row); the feature loss is
    smooth L1 between h / scale and the target's next feature / scale."""
    outs = draft(batch["features"], batch["tokens"], passes=recipe.unroll,
                 noise=recipe.noise if train else 0.0, detach=recipe.unroll_detach)
    total = 0.0
    figures = []
    scale = draft.feature_scale
    for s, (logits, pred) in enumerate(outs, start=1):
        valid = batch["valid"].clone()
        valid[:, : s - 1] = False
        valid &= (batch["top_ids"] >= 0).any(-1)
        rows = valid.flatten().nonzero().squeeze(1)
        ids = batch["top_ids"].flatten(0, 1)[rows]
        lp = batch["top_lp"].flatten(0, 1)[rows]
        ce, top1 = soft_target_loss(logits, rows, ids, lp)
        fl = F.smooth_l1_loss(pred[valid] / scale, batch["next_features"][valid] / scale)
        total = total + ce + recipe.feature_weight * fl
        figures.append(dict(ce=ce.item(), feat=fl.item(), top1=top1.item()))
    return total / len(outs), figures


def train(draft: FeatureDraft, examples: FeatureExamples, recipe: FeatureRecipe,
          ckpt: pathlib.Path | None = None, more_data=None, refresh_every: int = 100,
          held_out: FeatureExamples | None = None, eval_every: int = 0,
          progress: bool = True) -> dict:
    """AdamW, warm-up then cosine decay, gradient clipping; resumable from ``ckpt``.

    ``more_data()``: called every ``refresh_every`` steps, returns new records to add (data
    still being generated is used as it arrives). With ``held_out`` and ``eval_every`` the
    held-out figures are logged (not used to pick weights)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay,
                            betas=(0.9, 0.98))
    step = 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resumed at step %d", step)
    rng = random.Random(recipe.seed * 1000003 + step)
    torch.manual_seed(recipe.seed * 1000003 + step)

    def batches(ids: list[int]) -> list[list[int]]:  # length-bucketed
        order = sorted(ids, key=lambda i: len(examples.items[i]["tokens"]))
        return [order[i : i + recipe.batch] for i in range(0, len(order), recipe.batch)]

    pool: list[list[int]] = []
    seen = len(examples)
    ema: dict[str, float] = {}
    history = []
    draft.train()
    t0 = time.time()
    rows_done = 0
    bar = tqdm(total=recipe.steps, initial=step, desc="feature draft", unit="step",
               disable=not progress)
    while step < recipe.steps:
        if more_data is not None and step % refresh_every == 0:
            added = examples.add(more_data())
            if len(examples) > seen:  # fresh records are drawn first
                fresh = batches(list(range(seen, len(examples))))
                rng.shuffle(fresh)
                pool.extend(fresh)
                log.info("step %d: +%d rows (%d records, %d rows)", step, added,
                         len(examples), examples.rows)
                seen = len(examples)
        if not pool:
            pool = batches(list(range(len(examples))))
            rng.shuffle(pool)
        idx = pool.pop()
        batch = to_device(examples.batch(idx), draft)
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        loss, figs = chain_losses(draft, batch, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        rows_done += int(batch["valid"].sum())
        for s, f in enumerate(figs, start=1):
            for k, v in f.items():
                key = f"{k}{s}"
                ema[key] = v if key not in ema else 0.98 * ema[key] + 0.02 * v
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items() if k[:-1] in ("ce", "top1", "feat")})
        bar.update(1)
        if held_out is not None and eval_every and step % eval_every == 0:
            res = evaluate(draft, held_out, k_max=3)
            draft.train()
            history.append(dict(step=step, **res["step_agreement"]))
            log.info("step %d: held-out %s", step, res["step_agreement"])
        if ckpt is not None and (step % 100 == 0 or step == recipe.steps):
            save_checkpoint(ckpt, model=draft.state_dict(), opt=opt.state_dict(), step=step,
                            recipe=dataclasses.asdict(recipe))
    bar.close()
    draft.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), "rows_seen": rows_done,
            "train_rows": examples.rows, "train_records": len(examples),
            "ema": {k: round(v, 4) for k, v in ema.items()}, "history": history}


# -- evaluation -------------------------------------------------------------------------------


def chain_runs(draft: FeatureDraft, examples: FeatureExamples, k_max: int = 4,
               batch: int = 8) -> tuple[list[list[int]], list[list[list[bool]]]]:
    """Greedy drafting from every round start, teacher forced on the target's greedy answer.

    Returns (runs, agree): runs[s][j] = how many of the k_max tokens drafted for answer
    position j, j+1, ... agree with the target in a row (position 0 is the target's own first
    token: 0); agree[s][p][r] = pass p+1 at row r agrees (its own step, regardless of the
    chain's earlier steps)."""
    draft.eval()
    runs, agrees = [], []
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            idx = list(range(i, min(i + batch, len(examples))))
            b = to_device(examples.batch(idx), draft)
            outs = draft(b["features"], b["tokens"], passes=k_max)
            tgt = b["top_ids"][..., 0]  # the target's argmax for the token after each row
            ok = [(lg.argmax(-1) == tgt) & (tgt >= 0) for lg, _ in outs]  # [b, t] per pass
            for n, item in enumerate(idx):
                a = len(examples.items[item]["tokens"])
                rows = a - 1  # rows with a target
                ag = [[bool(ok[p][n, r]) if r >= p else False for r in range(rows)]
                      for p in range(k_max)]
                agrees.append(ag)
                run = [0]  # answer position 0: the target's first token, not drafted
                for j in range(1, a):
                    c, m = j - 1, 0  # chain from row c drafts positions j, j+1, ...
                    while m < k_max and c + m < rows and ag[m][c + m]:
                        m += 1
                    run.append(m)
                runs.append(run)
    return runs, agrees


def simulate_chain_tokens_per_round(runs: list[list[int]], k: int) -> float:
    """Mean tokens per round of greedy speculation at block k, given runs[s][j] (how many
    drafted tokens from position j on agree in a row, counted up to at least k)."""
    tokens = rounds = 0
    for run in runs:
        j = 0
        while j < len(run):
            step = min(min(run[j], k) + 1, len(run) - j)
            tokens += step
            rounds += 1
            j += step
    return tokens / max(rounds, 1)


def evaluate(draft: FeatureDraft, examples: FeatureExamples, k_max: int = 4) -> dict:
    """Held-out figures: per-step agreement (step s given steps < s agreed), step-1 agreement
    over all answer tokens (position 0 counted as a miss: it is the target's), tokens per round
    at k = 1..k_max."""
    runs, agrees = chain_runs(draft, examples, k_max)
    n_rows = sum(len(a[0]) for a in agrees)
    n_tokens = sum(len(r) for r in runs)
    step_agree = {}
    for s in range(1, k_max + 1):
        # step s counted at chain starts c where steps 1..s-1 agreed
        hit = tried = 0
        for ag in agrees:
            rows = len(ag[0])
            for c in range(rows - s + 1):
                if all(ag[u][c + u] for u in range(s - 1)):
                    tried += 1
                    hit += ag[s - 1][c + s - 1]
        step_agree[f"step{s}"] = round(hit / max(tried, 1), 4)
    step1_hits = sum(sum(a[0]) for a in agrees)
    tpr = {str(k): round(simulate_chain_tokens_per_round(runs, k), 3) for k in range(1, k_max + 1)}
    # the k = 1 figure is simulate_tokens_per_round's on the step-1 agreement (a check)
    k1 = simulate_tokens_per_round([[False] + a[0] for a in agrees], 1)
    assert abs(k1 - simulate_chain_tokens_per_round(runs, 1)) < 1e-9
    return {"rows": n_rows, "answer_tokens": n_tokens, "step_agreement": step_agree,
            "step1_over_all_tokens": round(step1_hits / max(n_tokens, 1), 4),
            "tokens_per_round": tpr}


# -- command line -----------------------------------------------------------------------------


def _held_out(dirs, vocab_map, vocab_size, layers=()) -> dict[str, FeatureExamples]:
    out = {}
    for d in dirs or []:
        ex = FeatureExamples(vocab_map, vocab_size, feature_layers=layers)
        ex.add(load_records(shard_paths(d)))
        out[pathlib.Path(d).name] = ex
    return out


def _build(recipe: FeatureRecipe, records: list[dict], out: pathlib.Path):
    """(draft, vocab_map): from out/init.pt if it exists (a resumed run), else from the target."""
    from specdec.models.hub import load_hf_model
    from specdec.models.tokenizer import eos_token_ids

    model, tokenizer = load_hf_model(recipe.target)
    init = out / "init.pt"
    if init.exists():
        saved = torch.load(init, weights_only=True)
    else:
        eos = eos_token_ids(tokenizer, model.config)
        saved = {"vocab_map": build_vocab(records, recipe.vocab, eos),
                 "feature_scale": feature_rms(records)}
        if recipe.layers:
            saved["tap_mean"], saved["tap_std"] = tap_stats(records, recipe.layers)
        torch.save(saved, init)
    vocab_map = saved["vocab_map"]
    draft = init_from_target(recipe, vocab_map, float(saved["feature_scale"]), model=model,
                             tap_stats=(saved["tap_mean"], saved["tap_std"]) if recipe.layers
                             else None)
    return draft, vocab_map, model.config.vocab_size


def trained(out: pathlib.Path) -> tuple[FeatureDraft, FeatureRecipe, torch.Tensor, int]:
    """(draft, recipe, vocab_map, target vocabulary size) of a run's checkpoint."""
    state = torch.load(out / "train.ckpt", weights_only=False)
    known = {f.name for f in dataclasses.fields(FeatureRecipe)}
    recipe = FeatureRecipe(**{k: v for k, v in state["recipe"].items() if k in known})
    draft, vocab_map, vsize = _build(recipe, [], out)
    draft.load_state_dict(state["model"])
    return draft.eval(), recipe, vocab_map, vsize


def main(argv=None, prog: str = "python -m specdec.distill.feature_draft") -> None:
    ap = argparse.ArgumentParser(prog=prog)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train (resumable) and evaluate")
    tr.add_argument("--data", required=True, help="directory of shard-*.pt with features")
    tr.add_argument("--out", required=True)
    tr.add_argument("--heldout", nargs="*", default=[], help="held-out shard directories")
    tr.add_argument("--max-shards", type=int, default=0, help="use at most this many (0: all)")
    tr.add_argument("--grow", action="store_true", help="add shards as they appear")
    tr.add_argument("--eval-every", type=int, default=0)
    tr.add_argument("--threads", type=int, default=1)
    for f in dataclasses.fields(FeatureRecipe):
        if f.name == "target":
            continue
        if f.type in ("bool", bool):
            tr.add_argument("--" + f.name.replace("_", "-"), action="store_true")
        else:
            typ = {"int": int, "float": float}.get(f.type, type(f.default))
            tr.add_argument("--" + f.name.replace("_", "-"), type=typ, default=f.default)
    hd = sub.add_parser("heldout", help="the held-out sets' target answers with features "
                                        "(OUT/heldout-NAME-features, for --heldout)")
    hd.add_argument("--out", required=True)
    hd.add_argument("--sets", nargs="+", default=["templated", "handwritten"])
    hd.add_argument("--prompts", type=int, default=48)
    hd.add_argument("--feature-layers", default="", help="the residual after these target "
                    "layers too (comma-separated: the --feature-layers of the draft to score)")
    hd.add_argument("--threads", type=int, default=1)
    ex = sub.add_parser("export", help="write a trained run's draft as a specdec draft "
                                       "directory (serve it: specdec serve-draft --model DIR)")
    ex.add_argument("--out", required=True)
    ex.add_argument("--draft-out", required=True)
    ex.add_argument("--threads", type=int, default=1)
    ev = sub.add_parser("eval", help="evaluate a trained draft on held-out sets")
    ev.add_argument("--out", required=True)
    ev.add_argument("--heldout", nargs="+", required=True)
    ev.add_argument("--k-max", type=int, default=4)
    ev.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.cmd == "heldout":
        from specdec.distill.cli import held_out_records

        for name in args.sets:
            held_out_records("default", out, args.prompts, 192, held_out=name, features=True,
                             feature_layers=parse_layers(args.feature_layers))
        return
    if args.cmd in ("eval", "export"):
        draft, recipe, vocab_map, vsize = trained(out)
    if args.cmd == "export":
        figures = out / "figures.json"
        card = {"recipe": dataclasses.asdict(recipe), "trained_in": str(out),
                **({"figures": json.loads(figures.read_text())} if figures.exists() else {})}
        save_draft(args.draft_out, draft, recipe.target, card)
        print(f"feature draft written to {args.draft_out}")
        return
    if args.cmd == "eval":
        res = {name: evaluate(draft, ex, args.k_max)
               for name, ex in _held_out(args.heldout, vocab_map, vsize,
                                         recipe.layers).items()}
        print(json.dumps(res, indent=1))
        (out / "eval.json").write_text(json.dumps(res, indent=1) + "\n")
        return

    recipe = FeatureRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FeatureRecipe)
                              if f.name != "target"})
    paths = shard_paths(args.data)
    if args.max_shards:
        paths = paths[: args.max_shards]
    records = load_records(paths)
    draft, vocab_map, vsize = _build(recipe, records, out)
    examples = FeatureExamples(vocab_map, vsize, recipe.max_answer, recipe.layers)
    examples.add(records)
    del records
    used = {p.name for p in paths}

    def more_data():
        new = [p for p in shard_paths(args.data) if p.name not in used]
        used.update(p.name for p in new)
        return load_records(new)

    held = _held_out(args.heldout, vocab_map, vsize, recipe.layers)
    first = next(iter(held.values()), None)
    log.info("train: %d records, %d rows; recipe %s", len(examples), examples.rows, recipe)
    figures = train(draft, examples, recipe, out / "train.ckpt",
                    more_data=more_data if args.grow else None, held_out=first,
                    eval_every=args.eval_every)
    figures["threads"] = args.threads
    figures["recipe"] = dataclasses.asdict(recipe)
    figures["held_out"] = {name: evaluate(draft, ex) for name, ex in held.items()}
    print(json.dumps(figures, indent=1))
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
