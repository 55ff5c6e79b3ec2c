"""Which of the feature draft's levers pay on the default target (issue 33): the study behind
docs/draft.md's "Feature layers, prompt context, depth" table.

Every variant trains the feature draft (``specdec.models.feature_model``) the same way, on the
same records, steps and seed, and is scored by teacher-forced greedy step-1 agreement on both
held-out sets (the issue's measure; ``feature_draft.evaluate``'s step 1). The variants:

- baseline: what ``specdec distill-feature train`` trains: rows over the answer, each reading
  the target's final-norm feature of the position before it;
- ``--context``: rows over the prompt too (the target's features of the prompt's positions),
  the loss still on the answer's rows only;
- ``--taps``: the input also reads the target's residual stream after layers 2 and 14 (low,
  middle and final, as EAGLE-3 fuses them), each dimension standardised (the middle layer has
  channels of RMS ~1,700 beside ~9 for the rest); a chained row, which has no target
  features, reads its own predicted final feature and the taps' means;
- ``--layers 2``: a second decoder layer (from target layer 28) before the first.

Two steps, both resumable (a finished shard is skipped, a finished variant too):

    python -m bench.feature_levers extract --data runs/eagle/data --out runs/levers/data --shards 40
    python -m bench.feature_levers extract --data runs/eagle/heldout-templated-features \\
        --out runs/levers/heldout-templated
    python -m bench.feature_levers extract --data runs/eagle/heldout-handwritten-features \\
        --out runs/levers/heldout-handwritten
    python -m bench.feature_levers train --levers runs/levers --out runs/levers/taps --taps

``extract`` adds to each record of a ``specdec distill --features`` shard ``full`` [prompt +
answer - 1, 3, hidden] float16: the residual after layers 2 and 14 and the final norm's output
at every position of prompt + answer[:-1], from one teacher-forced pass of specdec's engine
(its final rows equal the shard's stored features bit for bit; it checks). The product's own
route to such data is ``specdec distill --features --feature-layers 2,14`` (answers only),
and ``specdec distill-feature train --feature-layers 2,14`` trains the served draft on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from specdec.distill.feature_draft import feature_rms, load_records, shard_paths
from specdec.distill.train import build_vocab, lr_at, soft_target_loss
from specdec.models.draft_model import LAYER_PARAMS, target_weights
from specdec.models.feature_model import FeatureDraft, FeatureRecipe, init_from_target

TAPS = (2, 14)  # residual stream after these target layers, then the final norm's output
TOP = 32


# -- extract ----------------------------------------------------------------------------------


@torch.inference_mode()
def tapped_features(engine, records: list[dict]) -> list[torch.Tensor]:
    """Per record [prompt + answer - 1, 3, hidden] float16 (see the module docstring), from
    one pass of the engine with the layers tapped (``forward_features(layers=TAPS)``, what
    the target service runs for VerifyRequest.feature_layers)."""
    from specdec.serving.feature_engine import half_features

    feeds = [torch.cat([r["prompt"], r["answer"][:-1]]).long() for r in records]
    _, rows = engine.forward_features([engine.new_cache() for _ in records], feeds,
                                      [0] * len(feeds), [len(f) for f in feeds], layers=TAPS)
    return [half_features(r).unflatten(1, (len(TAPS) + 1, -1)) for r in rows]


def extract(args) -> None:
    from specdec.models.loading import load_engine

    engine, _, _ = load_engine("default", torch.device("cpu"))
    if engine.native is None:
        raise SystemExit("extract needs specdec's native kernels (the integer numerics)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_paths(args.data)[args.first : args.shards or None]
    for shard in tqdm(shards, desc="shards"):
        dest = out / shard.name
        if dest.exists():
            continue
        records = torch.load(shard, weights_only=True)
        for i in range(0, len(records), 8):
            part = records[i : i + 8]
            for r, full in zip(part, tapped_features(engine, part)):
                r["full"] = full
        r = records[0]
        if not torch.equal(r["full"][len(r["prompt"]) - 1 :, 2], r["features"].half()):
            raise SystemExit(f"{shard}: the final features differ from the stored ones")
        tmp = dest.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(dest)


# -- variants ---------------------------------------------------------------------------------


class LeverDraft(FeatureDraft):
    """The feature draft with an input over ``taps`` feature rows (the last one the final
    feature) and, with ``add_layer``, a second layer first."""

    def use_taps(self, tap_mean: torch.Tensor, tap_std: torch.Tensor) -> None:
        """tap_mean / tap_std [taps, hidden]; fc widens to read every tap (the new columns
        start near zero, so the draft starts as the one-tap draft)."""
        h, taps = self.arch.hidden_size, tap_mean.shape[0]
        self.register_buffer("tap_mean", tap_mean.clone())
        self.register_buffer("tap_std", tap_std.clone())
        if taps > 1:
            old = self.fc
            self.fc = nn.Linear((taps + 1) * h, h, bias=True)
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight.add_(torch.randn_like(self.fc.weight) * 0.01)
                self.fc.weight[:, (taps - 1) * h :] = old.weight
                self.fc.bias.copy_(old.bias)

    def add_layer(self, weights: dict[str, torch.Tensor], layer: int = 28) -> None:
        self.extra = nn.ParameterDict({n: nn.Parameter(weights[f"layers.{layer}.{n}"].float().clone())
                                       for n in LAYER_PARAMS})

    def rows(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features [b, t, taps * hidden], or [b, t, hidden] (a chained row's own prediction:
        the other taps read as their means)."""
        h, taps = self.arch.hidden_size, self.tap_mean.shape[0]
        f = features.view(*features.shape[:2], -1, h)
        if f.shape[2] < taps:
            f = torch.cat([self.tap_mean[: taps - f.shape[2]].expand(*f.shape[:2], -1, -1), f], 2)
        parts = (f - self.tap_mean) / self.tap_std
        return self.fc(torch.cat([parts.flatten(2), self.embed[tokens] / self.embed_scale], -1))

    def forward(self, features, tokens, passes=1, noise=0.0, detach=False):
        if not hasattr(self, "extra"):
            return super().forward(features, tokens, passes, noise, detach)
        assert passes == 1 and noise == 0.0, "the two-layer variant is scored at step 1"
        pos = torch.arange(features.shape[1], device=features.device)
        x = self.rows(features, tokens)
        main = self.params
        try:  # _qkv / _finish read self.params: run the extra layer's through them first
            for prm in (self.extra, main):
                self._modules["params"] = prm
                q, k, v = self._qkv(x, pos)
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=self.arch.num_heads != self.arch.num_kv_heads)
                x = self._finish(x, o)
        finally:
            self._modules["params"] = main
        return [self.outputs(x)]


def item(r: dict, to_draft: torch.Tensor, context: bool, taps: int, max_answer: int = 192) -> dict:
    """A record as rows m = first .. P + a - 1 reading (features of position m - 1, token m);
    row m's target is token m + 1, scored for the answer's rows m = P .. P + a - 2."""
    P, a = len(r["prompt"]), min(len(r["answer"]), max_answer)
    seq = torch.cat([r["prompt"], r["answer"][:a]]).long()
    first = 1 if context else P
    feats = r["full"][first - 1 : P + a - 1, 3 - taps :]  # [rows, taps, hidden]
    n, lo = len(seq) - first, P - first  # lo: the first scored row
    top_ids = torch.full((n, TOP), -1, dtype=torch.long)
    top_lp = torch.zeros(n, TOP, dtype=torch.float16)
    valid = torch.zeros(n, dtype=torch.bool)
    top_ids[lo : lo + a - 1] = to_draft[r["top_ids"][1:a].long()]
    top_lp[lo : lo + a - 1] = r["top_logprobs"][1:a]
    valid[lo : lo + a - 1] = True
    return dict(features=feats.half(), tokens=seq[first:], top_ids=top_ids, top_lp=top_lp,
                valid=valid)


def batch_of(items: list[dict]) -> dict:
    """Padded: features [b, t, taps * hidden], tokens [b, t], top_ids / top_lp [b, t, 32],
    valid [b, t], next_features [b, t, hidden] (the final feature of the row after)."""
    t, b = max(len(i["tokens"]) for i in items), len(items)
    taps, h = items[0]["features"].shape[1:]
    feats = torch.zeros(b, t, taps, h)
    tokens = torch.zeros(b, t, dtype=torch.long)
    top_ids = torch.full((b, t, TOP), -1, dtype=torch.long)
    top_lp = torch.zeros(b, t, TOP)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for j, it in enumerate(items):
        n = len(it["tokens"])
        feats[j, :n], tokens[j, :n] = it["features"].float(), it["tokens"]
        top_ids[j, :n], top_lp[j, :n], valid[j, :n] = it["top_ids"], it["top_lp"].float(), it["valid"]
    nxt = torch.cat([feats[:, 1:, -1], torch.zeros_like(feats[:, :1, -1])], 1)
    return dict(features=feats.flatten(2), tokens=tokens, top_ids=top_ids, top_lp=top_lp,
                valid=valid, next_features=nxt)


@torch.no_grad()
def step1_agreement(draft: LeverDraft, items: list[dict]) -> float:
    """Teacher-forced greedy step-1 agreement over the scored rows (a target token outside
    the draft vocabulary counts as a miss), as ``feature_draft.evaluate``'s step 1."""
    draft.eval()
    hit = n = 0
    for i in range(0, len(items), 8):
        b = batch_of(items[i : i + 8])
        (logits, _), = draft(b["features"], b["tokens"], passes=1)
        hit += int(((logits.argmax(-1) == b["top_ids"][..., 0]) & b["valid"]).sum())
        n += int(b["valid"].sum())
    draft.train()
    return hit / n


def train(args) -> None:
    out = pathlib.Path(args.out)
    if (out / "result.json").exists():
        print((out / "result.json").read_text())
        return
    out.mkdir(parents=True, exist_ok=True)
    from specdec.models.hub import load_hf_model
    from specdec.models.tokenizer import eos_token_ids

    torch.manual_seed(args.seed)
    levers = pathlib.Path(args.levers)
    recipe = FeatureRecipe(batch=args.batch, steps=args.steps, seed=args.seed)
    records = load_records(shard_paths(levers / "data")[: args.shards])
    model, tokenizer = load_hf_model("default")
    init = levers / "init.pt"  # one vocabulary and scale for every variant
    if init.exists():
        saved = torch.load(init, weights_only=True)
        vocab_map, scale = saved["vocab_map"], float(saved["scale"])
    else:
        vocab_map = build_vocab(records, recipe.vocab, eos_token_ids(tokenizer, model.config))
        scale = feature_rms(records)
        torch.save({"vocab_map": vocab_map, "scale": scale}, init)
    to_draft = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    to_draft[vocab_map] = torch.arange(len(vocab_map))
    taps = 3 if args.taps else 1
    sample = torch.cat([r["full"].float() for r in records[:64]])  # [n, 3, hidden]
    tap_mean, tap_std = sample.mean(0), sample.std(0) + 1e-3
    tap_mean[2], tap_std[2] = 0.0, scale  # the final feature read as the served draft does
    del sample

    base = init_from_target(recipe, vocab_map, scale, model=model)
    draft = LeverDraft(base.arch, base.embed, vocab_map, scale)
    draft.load_state_dict(base.state_dict(), strict=False)
    draft.use_taps(tap_mean[3 - taps :], tap_std[3 - taps :])
    if args.layers == 2:
        draft.add_layer(target_weights("default", model)[1])
    items = [item(r, to_draft, args.context, taps) for r in records]
    del records
    held = {name: [item(r, to_draft, args.context, taps)
                   for r in load_records(shard_paths(levers / f"heldout-{name}"))]
            for name in ("templated", "handwritten")}

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    order = sorted(range(len(items)), key=lambda i: len(items[i]["tokens"]))  # length buckets
    pool: list[list[int]] = []
    history, t0 = [], time.time()
    draft.train()
    for step in tqdm(range(args.steps), desc=out.name, mininterval=30):
        if not pool:
            pool = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
            rng.shuffle(pool)
        b = batch_of([items[i] for i in pool.pop()])
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        (logits, pred), = draft(b["features"], b["tokens"], passes=1)
        valid = b["valid"] & (b["top_ids"] >= 0).any(-1)
        rows = valid.flatten().nonzero().squeeze(1)
        ce, top1 = soft_target_loss(logits, rows, b["top_ids"].flatten(0, 1)[rows],
                                    b["top_lp"].flatten(0, 1)[rows])
        feat = F.smooth_l1_loss(pred[valid] / scale, b["next_features"][valid] / scale)
        opt.zero_grad(set_to_none=True)
        (ce + recipe.feature_weight * feat).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            history.append(dict(step=step + 1, train_top1=round(float(top1), 3),
                                **{n: round(step1_agreement(draft, h), 4) for n, h in held.items()}))
            tqdm.write(json.dumps(history[-1]))
    result = dict(args=vars(args), seconds=round(time.time() - t0), history=history)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.feature_levers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (both steps)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="add the tapped features to distill --features shards")
    ex.add_argument("--data", required=True)
    ex.add_argument("--out", required=True)
    ex.add_argument("--shards", type=int, default=0, help="up to shard N (0: all)")
    ex.add_argument("--first", type=int, default=0, help="from shard N")
    tr = sub.add_parser("train", help="train and score one variant")
    tr.add_argument("--levers", required=True, help="extract's --out")
    tr.add_argument("--out", required=True)
    tr.add_argument("--context", action="store_true")
    tr.add_argument("--taps", action="store_true")
    tr.add_argument("--layers", type=int, default=1, choices=(1, 2))
    tr.add_argument("--shards", type=int, default=40)
    tr.add_argument("--steps", type=int, default=500)
    tr.add_argument("--batch", type=int, default=16)
    tr.add_argument("--eval-every", type=int, default=200)
    tr.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"extract": extract, "train": train}[args.cmd](args)


if __name__ == "__main__":
    main()
