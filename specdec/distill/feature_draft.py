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

CLI (CPU; see ``python -m specdec.distill.feature_draft --help``)::

    python -m specdec.distill.feature_draft train --data runs/eagle/data --out runs/eagle/f1 \
        --steps 1500 --heldout runs/eagle/heldout-templated
    python -m specdec.distill.feature_draft eval --out runs/eagle/f1 \
        --heldout runs/eagle/heldout-templated runs/eagle/heldout-handwritten
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from specdec.distill.train import build_vocab, simulate_tokens_per_round, soft_target_loss
from specdec.serving.arch import ArchConfig, rope_inv_freq

log = logging.getLogger(__name__)

LAYER_PARAMS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


@dataclasses.dataclass
class FeatureRecipe:
    target: str = "default"
    init_layer: int = -1  # target layer the draft's layer starts from (negative: from the end)
    random_layer: bool = False  # start the layer from random weights instead
    fc_init: str = "identity"  # fc starts as [I, I] (feature + token embedding), or "random"
    feature_out: str = "norm"  # predicted feature: "norm" = the draft's RMSNorm output (what
    # its head reads; norm starts as the target's final norm) or "residual" = the layer output
    freeze_head: bool = False  # keep the head at the target's embedding rows (as EAGLE does)
    vocab: int = 8192
    max_answer: int = 192  # rows per record kept (answers are at most 192 tokens anyway)
    batch: int = 8  # records per step
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    feature_weight: float = 5.0  # weight of the smooth-L1 feature regression (on scaled
    # features); 5 beat 1 at every step (held-out step 1, 2: 0.257, 0.238 vs 0.251, 0.180)
    noise: float = 0.0  # uniform noise on input features, +- this times the feature RMS
    unroll: int = 1  # passes trained per step: 1 = teacher forced; 2-3 = own features fed
    unroll_detach: bool = False  # stop gradients through the fed predicted features
    seed: int = 0


# -- model ------------------------------------------------------------------------------------


@dataclasses.dataclass
class DraftCache:
    """The draft's own keys and values, [1, kv_heads, length, head_dim] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, length: int) -> None:
        """Drop rows from ``length`` on (after the target rejected drafted tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def chain_mask(passes: int, t: int, device=None) -> torch.Tensor:
    """[passes * t, passes * t] bool: query (pass s, row r) may attend key (pass u, row j).

    Pass 1 is causal over true rows. A row of pass s >= 2 is step s of the chain that started
    at true row c = r - s + 1: it sees true rows j <= c and, of each pass u = 2..s, row c+u-1.
    """
    r = torch.arange(t, device=device)
    blocks = []
    for s in range(1, passes + 1):
        row = []
        c = r - s + 1  # chain start of each query row
        for u in range(1, passes + 1):
            j = r[None, :]
            if u == 1:
                m = j <= c[:, None]
            elif u <= s:
                m = j == (c + u - 1)[:, None]
            else:
                m = torch.zeros(t, t, dtype=torch.bool, device=device)
            row.append(m)
        blocks.append(torch.cat(row, 1))
    return torch.cat(blocks, 0)  # every query sees at least itself (pass s, row r)


class FeatureDraft(nn.Module):
    """fc([feature; embed(token)]) -> one Llama layer -> (RMSNorm -> head, predicted feature).

    ``embed`` (the target's input embedding) is a frozen buffer, not stored with the draft.
    ``feature_scale``: the RMS of the target's features (regression loss and noise are scaled
    by it; with ``feature_out="residual"`` the output norm starts at it). The fc reads the
    feature and the embedding each divided by its RMS: SmolLM2's embeddings are ~15x smaller
    than its features, and unscaled the token was drowned (held-out step-1 agreement 0.16 /
    0.13 against 0.22 / 0.21 scaled, templated / handwritten, 200 steps on 62k rows).
    """

    def __init__(self, arch: ArchConfig, embed: torch.Tensor, vocab_map: torch.Tensor,
                 feature_scale: float = 1.0, feature_out: str = "norm"):
        super().__init__()
        if feature_out not in ("norm", "residual"):
            raise ValueError(f"feature_out: norm or residual, not {feature_out!r}")
        self.feature_out = feature_out
        beyond = [f for f in arch.features() if f != "rope_scaling"]
        if beyond:
            raise ValueError(f"the feature draft models a Llama block; target has {beyond}")
        self.arch = a = arch
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("vocab_map", vocab_map.long())
        self.register_buffer("feature_scale", torch.tensor(float(feature_scale)))
        self.register_buffer("embed_scale", embed.float().pow(2).mean().sqrt(), persistent=False)
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=True)
        self.params = nn.ParameterDict({
            "attn_norm": nn.Parameter(torch.ones(a.hidden_size)),
            "wqkv": nn.Parameter(torch.randn((hq + 2 * hkv) * d, a.hidden_size) * 0.02),
            "wo": nn.Parameter(torch.randn(a.hidden_size, hq * d) * 0.02),
            "mlp_norm": nn.Parameter(torch.ones(a.hidden_size)),
            "w_gate_up": nn.Parameter(torch.randn(2 * a.intermediate_size, a.hidden_size) * 0.02),
            "w_down": nn.Parameter(torch.randn(a.hidden_size, a.intermediate_size) * 0.02),
            "norm": nn.Parameter(torch.full((a.hidden_size,), float(feature_scale))),
            "head": nn.Parameter(torch.randn(len(vocab_map), a.hidden_size) * 0.02),
        })
        inv_freq = rope_inv_freq(a.rope_theta, a.rope_scaling, d, a.max_context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # pieces

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps))

    def rows(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input rows: fc([feature; embed(token)]), each part at unit RMS."""
        return self.fc(torch.cat([features / self.feature_scale,
                                  self.embed[tokens] / self.embed_scale], -1))

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [b, t, hidden], pos [t] -> q [b, hq, t, d], k and v [b, hkv, t, d] (RoPE'd)."""
        a = self.arch
        b, t, _ = x.shape
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        h = self._norm(x, self.params["attn_norm"])
        q, k, v = F.linear(h, self.params["wqkv"]).split([hq * d, hkv * d, hkv * d], -1)
        ang = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]

        def rope(z):
            z1, z2 = z.chunk(2, -1)
            return z * cos + torch.cat((-z2, z1), -1) * sin

        q = rope(q.view(b, t, hq, d).transpose(1, 2))
        k = rope(k.view(b, t, hkv, d).transpose(1, 2))
        return q, k, v.view(b, t, hkv, d).transpose(1, 2)

    def _finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Attention output o [b, hq, t, d] -> h [b, t, hidden] (residual, MLP)."""
        b, _, t, _ = o.shape
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), self.params["wo"])
        gate, up = F.linear(self._norm(x, self.params["mlp_norm"]), self.params["w_gate_up"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, self.params["w_down"])

    def outputs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer output h -> (logits over the draft vocabulary, predicted next feature)."""
        y = self._norm(h, self.params["norm"])
        return F.linear(y, self.params["head"]), (y if self.feature_out == "norm" else h)

    # whole sequences (training, evaluation)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, passes: int = 1,
                noise: float = 0.0, detach: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [b, t, hidden] (the target's, row t), tokens [b, t] (emitted at row t).

        Returns per pass s = 1..passes (logits [b, t, vocab_out], h [b, t, hidden]): pass s at
        row r is step s of the chain started at true row r - s + 1 (valid for r >= s - 1).
        ``noise``: uniform noise on the true input features (+- noise * feature RMS).
        """
        b, t, _ = features.shape
        a = self.arch
        pos = torch.arange(t, device=features.device)
        if noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * noise * self.feature_scale
        xs, qs, ks, vs = [], [], [], []
        outs = []
        feed = features
        for s in range(1, passes + 1):
            x = self.rows(feed, tokens)
            q, k, v = self._qkv(x, pos)
            xs.append(x), qs.append(q), ks.append(k), vs.append(v)
            if s == 1:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   enable_gqa=a.num_heads != a.num_kv_heads)
            else:
                mask = chain_mask(s, t, features.device)[(s - 1) * t:]  # this pass's queries
                o = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                                   attn_mask=mask,
                                                   enable_gqa=a.num_heads != a.num_kv_heads)
            h = self._finish(x, o)
            logits, pred = self.outputs(h)
            outs.append((logits, pred))
            if s < passes:  # next pass, row r: fed the prediction of row r - 1
                prev = pred.detach() if detach else pred
                feed = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        return outs

    # serving: token by token over the draft's own cache

    def new_cache(self) -> DraftCache:
        return DraftCache()

    @torch.no_grad()
    def step(self, cache: DraftCache, features: torch.Tensor, tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append rows (features [n, hidden], tokens [n]) to ``cache``; return their logits
        over the draft vocabulary [n, vocab_out] and predicted next features [n, hidden].

        After the target verifies, truncate the cache to the accepted rows and append those
        again with the target's true features; drafted rows use the draft's own features.
        """
        n = tokens.shape[0]
        x = self.rows(features[None].float(), tokens[None])
        pos = torch.arange(cache.length, cache.length + n, device=x.device)
        q, k, v = self._qkv(x, pos)
        cache.k = k if cache.k is None else torch.cat([cache.k, k], 2)
        cache.v = v if cache.v is None else torch.cat([cache.v, v], 2)
        total = cache.length
        mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
        o = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=mask,
                                           enable_gqa=self.arch.num_heads != self.arch.num_kv_heads)
        h = self._finish(x, o)
        logits, pred = self.outputs(h)
        return logits[0], pred[0]

    def token_ids(self, out_ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_map[out_ids]


def init_from_target(recipe: FeatureRecipe, vocab_map: torch.Tensor, feature_scale: float,
                     model=None) -> FeatureDraft:
    """A FeatureDraft with the layer from target layer ``recipe.init_layer`` and the head from
    the target's (tied) embedding rows of the draft vocabulary."""
    from specdec.models.hub import load_hf_model
    from specdec.serving.arch import canonical_weights

    if model is None:
        model, _ = load_hf_model(recipe.target)
    arch_t = ArchConfig.from_hf(model.config)
    weights = canonical_weights(model.state_dict(), arch_t)
    arch = dataclasses.replace(arch_t, num_layers=1)
    draft = FeatureDraft(arch, weights["embed"].float().clone(), vocab_map, feature_scale,
                         recipe.feature_out)
    with torch.no_grad():
        draft.params["head"].copy_(weights["head"][vocab_map])
        if recipe.feature_out == "norm":  # its output is then the target's kind of feature
            draft.params["norm"].copy_(weights["norm"])
        if recipe.fc_init == "identity":  # features and (tied) embeddings share one basis
            h = arch.hidden_size
            draft.fc.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], 1))
            draft.fc.weight.add_(torch.randn_like(draft.fc.weight) * 0.01)
            draft.fc.bias.zero_()
        elif recipe.fc_init != "random":
            raise ValueError(f"fc_init: identity or random, not {recipe.fc_init!r}")
        if not recipe.random_layer:
            src = recipe.init_layer % arch_t.num_layers
            for name in LAYER_PARAMS:
                draft.params[name].copy_(weights[f"layers.{src}.{name}"])
    draft.params["head"].requires_grad_(not recipe.freeze_head)
    return draft


# -- data -------------------------------------------------------------------------------------


class FeatureExamples:
    """Records with features, as rows (feature_i, answer_i) -> targets at i + 1."""

    def __init__(self, vocab_map: torch.Tensor, vocab_size: int, max_answer: int = 192):
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_draft[vocab_map] = torch.arange(len(vocab_map))
        self.max_answer = max_answer
        self.items: list[dict] = []

    def add(self, records: list[dict]) -> int:
        """Add records (those with >= 2 answer tokens); returns the number of rows added."""
        n = 0
        for r in records:
            a = min(len(r["answer"]), self.max_answer)
            if a < 2:
                continue
            self.items.append(dict(
                tokens=r["answer"][:a].long(), features=r["features"][:a].half(),
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
        """Padded batch: features [b, t, hidden] float, tokens [b, t], per-row targets at
        row r (r < len - 1): top_ids/top_lp [b, t, 32] (ids -1 = pad or outside the draft
        vocabulary), next_features [b, t, hidden], valid [b, t]."""
        items = [self.items[i] for i in idx]
        t = max(len(it["tokens"]) for it in items)
        hidden, top = items[0]["features"].shape[1], items[0]["top_ids"].shape[1]
        feats = torch.zeros(len(items), t, hidden)
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
        next_feats = torch.cat([feats[:, 1:], torch.zeros_like(feats[:, :1])], 1)
        return dict(features=feats, tokens=tokens, top_ids=top_ids, top_lp=top_lp,
                    next_features=next_feats, valid=valid)


def feature_rms(records: list[dict], n: int = 64) -> float:
    """RMS of the target's features (over the first ``n`` records)."""
    f = torch.cat([r["features"].float() for r in records[:n]])
    return float(f.pow(2).mean().sqrt())


def shard_paths(data_dir) -> list[pathlib.Path]:
    return sorted(pathlib.Path(data_dir).glob("shard-*.pt"))


def load_records(paths) -> list[dict]:
    out = []
    for p in paths:
        out.extend(torch.load(p, weights_only=True))
    return out


# -- training ---------------------------------------------------------------------------------


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

    def lr_at(s: int) -> float:
        if s < recipe.warmup:
            return recipe.lr * (s + 1) / recipe.warmup
        frac = (s - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

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
        batch = examples.batch(idx)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
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
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step,
                        "recipe": dataclasses.asdict(recipe)}, tmp)
            tmp.rename(ckpt)
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
            b = examples.batch(idx)
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


def _held_out(dirs, vocab_map, vocab_size) -> dict[str, FeatureExamples]:
    out = {}
    for d in dirs or []:
        ex = FeatureExamples(vocab_map, vocab_size)
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
        vocab_map, scale = saved["vocab_map"], float(saved["feature_scale"])
    else:
        eos = eos_token_ids(tokenizer, model.config)
        vocab_map = build_vocab(records, recipe.vocab, eos)
        scale = feature_rms(records)
        torch.save({"vocab_map": vocab_map, "feature_scale": scale}, init)
    draft = init_from_target(recipe, vocab_map, scale, model=model)
    return draft, vocab_map, model.config.vocab_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specdec.distill.feature_draft")
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

    if args.cmd == "eval":
        state = torch.load(out / "train.ckpt", weights_only=False)
        known = {f.name for f in dataclasses.fields(FeatureRecipe)}
        recipe = FeatureRecipe(**{k: v for k, v in state["recipe"].items() if k in known})
        draft, vocab_map, vsize = _build(recipe, [], out)
        draft.load_state_dict(state["model"])
        res = {name: evaluate(draft, ex, args.k_max)
               for name, ex in _held_out(args.heldout, vocab_map, vsize).items()}
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
    examples = FeatureExamples(vocab_map, vsize, recipe.max_answer)
    examples.add(records)
    del records
    used = {p.name for p in paths}

    def more_data():
        new = [p for p in shard_paths(args.data) if p.name not in used]
        used.update(p.name for p in new)
        return load_records(new)

    held = _held_out(args.heldout, vocab_map, vsize)
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
