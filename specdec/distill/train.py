"""``specdec distill``: build a draft for a target by distillation, and evaluate drafts.

Recipe (what measured best here, see docs/draft.md):
1. data: the target answers hundreds of shipped prompts (greedy and sampled), keeping its
   top-32 log-probs per answer token (specdec.distill.data), optionally plus plain text files
   scored by the target (teacher forcing);
2. vocabulary: the draft's head covers the N tokens the target writes most (exact: the draft's
   q is zero elsewhere, and q is what it samples from);
3. model: a few Llama layers initialised from target layers, the target's frozen input
   embedding, the head initialised from the target's embedding rows;
4. loss: cross-entropy to the target's renormalised top-32 distribution (forward KL);
5. evaluation on held-out prompts (topics never in training): greedy acceptance, simulated
   tokens per round for k = 1..8, measured cost ratio, predicted speedups.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import random

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.models import draft_model
from specdec.models.draft_model import LAYER_PARAMS, DraftModule
from specdec.serving.arch import ArchConfig
from specdec.serving.engine import LlamaEngine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Recipe:
    target: str = "default"
    layers: tuple[int, ...] = (0, 29)  # target layers the draft's layers start from
    vocab: int = 8192
    max_len: int = 384
    batch: int = 16
    steps: int = 600
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    seed: int = 0
    train_embed: bool = False


# -- data -------------------------------------------------------------------------------------


def build_vocab(records: list[dict], size: int, eos_ids: list[int]) -> torch.Tensor:
    """The ``size`` token ids the target writes most (EOS always in), most frequent first."""
    counts: dict[int, int] = {}
    for r in records:
        for t in r["answer"].tolist():
            counts[t] = counts.get(t, 0) + 1
        for t in r["top_ids"][:, :4].flatten().tolist():  # near-misses matter for q too
            counts[t] = counts.get(t, 0) + 0  # present, but ranked after written tokens
    order = sorted(counts, key=lambda t: -counts[t])
    ids = [t for t in eos_ids] + [t for t in order if t not in eos_ids]
    return torch.tensor(ids[:size], dtype=torch.long)


def coverage(records: list[dict], vocab_map: torch.Tensor) -> float:
    inside = torch.zeros(int(vocab_map.max()) + 1 if len(vocab_map) else 1, dtype=torch.bool)
    inside[vocab_map] = True
    hit = total = 0
    for r in records:
        a = r["answer"].long()
        ok = a < inside.shape[0]
        hit += int(inside[a[ok]].sum())
        total += len(a)
    return hit / max(total, 1)


class Examples:
    """Training sequences with soft targets over the draft vocabulary."""

    def __init__(self, records: list[dict], vocab_map: torch.Tensor, vocab_size: int, max_len: int):
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_draft[vocab_map] = torch.arange(len(vocab_map))
        self.items = []
        for r in records:
            prompt, answer = r["prompt"].long(), r["answer"].long()
            seq = torch.cat([prompt, answer])[:max_len]
            n_ans = len(seq) - len(prompt)
            if n_ans <= 0:
                continue
            self.items.append((seq, len(prompt), r["top_ids"][:n_ans].long(),
                               r["top_logprobs"][:n_ans].float()))

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, idx: list[int]):
        """(tokens [b, t], positions' soft targets: rows [n], cols [n, 32], probs [n, 32])."""
        items = [self.items[i] for i in idx]
        t = max(len(s) for s, *_ in items)
        tokens = torch.zeros(len(items), t, dtype=torch.long)
        rows, tgt_ids, tgt_lp = [], [], []
        for b, (seq, n_prompt, top_ids, top_lp) in enumerate(items):
            tokens[b, : len(seq)] = seq
            # logits at position p predict token p + 1: answer token j is predicted at
            # position n_prompt - 1 + j
            pos = torch.arange(n_prompt - 1, n_prompt - 1 + len(top_ids))
            rows.append(b * t + pos)
            tgt_ids.append(self.to_draft[top_ids])
            tgt_lp.append(top_lp)
        # records scored with top-N and records labelled by their own tokens (one column)
        # share a batch: narrower ones are padded with id -1 (dropped by the loss)
        width = max(x.shape[1] for x in tgt_ids)
        tgt_ids = [F.pad(x, (0, width - x.shape[1]), value=-1) for x in tgt_ids]
        tgt_lp = [F.pad(x, (0, width - x.shape[1]), value=0.0) for x in tgt_lp]
        return tokens, torch.cat(rows), torch.cat(tgt_ids), torch.cat(tgt_lp)


def soft_target_loss(logits: torch.Tensor, rows, tgt_ids, tgt_lp) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy to the target's top-N distribution renormalised over the draft vocab.

    logits: [b, t, vocab_out]; rows: [n] flat positions; tgt_ids/tgt_lp: [n, top] (ids -1 =
    outside the draft vocabulary, dropped). Returns (loss, top-1 agreement on these rows).
    """
    flat = logits.reshape(-1, logits.shape[-1])[rows]  # [n, vocab_out]
    logq = flat.float().log_softmax(-1)
    valid = tgt_ids >= 0
    p = torch.where(valid, tgt_lp.exp(), torch.zeros_like(tgt_lp))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    gathered = logq.gather(1, tgt_ids.clamp_min(0))  # [n, top]
    loss = -(p * gathered).sum(-1)
    keep = valid.any(-1)
    agree = (flat.argmax(-1) == tgt_ids[:, 0]) & (tgt_ids[:, 0] >= 0)
    return loss[keep].mean(), agree.float().mean()


# -- model ------------------------------------------------------------------------------------


def init_from_target(recipe: Recipe, vocab_map: torch.Tensor,
                     model=None) -> tuple[DraftModule, ArchConfig]:
    """A draft module initialised from the target (``model``, or loaded from recipe.target)."""
    arch_t, weights = draft_model.target_weights(recipe.target, model)
    arch = dataclasses.replace(arch_t, num_layers=len(recipe.layers))
    init = {"norm": weights["norm"], "head": weights["head"][vocab_map]}
    for i, src in enumerate(recipe.layers):
        for name in LAYER_PARAMS:
            init[f"layers.{i}.{name}"] = weights[f"layers.{src}.{name}"]
    module = DraftModule(arch, weights["embed"].clone(), vocab_map)
    module.load_canonical(init)
    return module, arch


def init_from_draft(path) -> tuple[DraftModule, ArchConfig, torch.Tensor]:
    """A draft module holding a specdec draft's own weights (to train it on: fine-tuning a
    shipped draft on more of its target's answers keeps all it learnt), with its arch and
    its head's vocabulary map."""
    meta, weights = draft_model.load_weights(path)
    arch = ArchConfig(**meta["arch"])
    vocab_map = weights.pop("vocab_map").long()
    embed = weights.pop("embed").float()
    module = DraftModule(arch, embed, vocab_map)
    module.load_canonical({k: v.float() for k, v in weights.items()})
    return module, arch, vocab_map


def grow_draft(module: DraftModule, sources: tuple[int, ...], target: str = "default",
               model=None) -> tuple[DraftModule, ArchConfig]:
    """A deeper draft computing exactly what ``module`` computes: new layers, started from the
    target's layers ``sources``, go before its last layer with their output projections (wo,
    w_down) zero, so each adds nothing to the residual stream until training moves them."""
    _, weights = draft_model.target_weights(target, model)
    old = module.canonical()
    n = module.arch.num_layers
    arch = dataclasses.replace(module.arch, num_layers=n + len(sources))
    order = [("draft", i) for i in range(n - 1)] + [("target", s) for s in sources] \
        + [("draft", n - 1)]
    init = {"norm": old["norm"], "head": old["head"]}
    for i, (kind, src) in enumerate(order):
        for name in LAYER_PARAMS:
            if kind == "draft":
                init[f"layers.{i}.{name}"] = old[f"layers.{src}.{name}"]
            elif name in ("wo", "w_down"):
                init[f"layers.{i}.{name}"] = torch.zeros_like(weights[f"layers.{src}.{name}"])
            else:
                init[f"layers.{i}.{name}"] = weights[f"layers.{src}.{name}"]
    grown = DraftModule(arch, module.embed, module.vocab_map)
    grown.load_canonical(init)
    return grown, arch


# -- training ---------------------------------------------------------------------------------


def lr_at(recipe, step: int) -> float:
    """Linear warm-up over ``recipe.warmup`` steps, then cosine decay to 0.1 of ``recipe.lr``
    at ``recipe.steps``."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_checkpoint(ckpt: pathlib.Path, **state) -> None:
    """Write a training checkpoint whole or not at all (a killed run resumes from the last)."""
    tmp = ckpt.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(ckpt)


def train(module: DraftModule, examples: Examples, recipe: Recipe, ckpt: pathlib.Path | None,
          held_out: Examples | None = None, eval_every: int = 0) -> dict:
    """AdamW with warmup + cosine decay; resumable from ``ckpt``. Returns training figures.

    Runs on the module's device. With ``held_out`` and ``eval_every``, the held-out top-1
    agreement is measured every ``eval_every`` steps and the best weights are kept (early
    stopping against over-fitting a small data set).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    device = params[0].device
    best = (-1.0, None, 0)  # (held-out top-1, state, step)
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay,
                            betas=(0.9, 0.98))
    step = 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        module.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resumed training at step %d", step)
    rng = random.Random(recipe.seed + step)
    # bucket by length so padding stays small
    order = sorted(range(len(examples)), key=lambda i: len(examples.items[i][0]))
    batches = [order[i : i + recipe.batch] for i in range(0, len(order), recipe.batch)]

    module.train()
    ema_loss = ema_agree = None
    bar = tqdm(total=recipe.steps, initial=step, desc="distill", unit="step")
    pool: list[list[int]] = []
    while step < recipe.steps:
        if not pool:
            pool = list(batches)
            rng.shuffle(pool)
        idx = pool.pop()
        tokens, rows, tgt_ids, tgt_lp = (x.to(device) for x in examples.batch(idx))
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        logits = module(tokens)
        loss, agree = soft_target_loss(logits, rows, tgt_ids, tgt_lp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        ema_agree = agree.item() if ema_agree is None else 0.95 * ema_agree + 0.05 * agree.item()
        bar.set_postfix(loss=f"{ema_loss:.3f}", top1=f"{ema_agree:.3f}")
        bar.update(1)
        if held_out is not None and eval_every and (step % eval_every == 0 or step == recipe.steps):
            score = teacher_forced_agreement(module, held_out)
            module.train()
            if score > best[0]:
                best = (score, {k: v.detach().clone() for k, v in module.state_dict().items()}, step)
            log.info("step %d: held-out top-1 %.4f (best %.4f at %d)", step, score, best[0], best[2])
        if ckpt is not None and (step % 50 == 0 or step == recipe.steps):
            save_checkpoint(ckpt, model=module.state_dict(), opt=opt.state_dict(), step=step)
    bar.close()
    module.eval()
    out = {"steps": step, "train_loss_ema": ema_loss, "train_top1_ema": ema_agree}
    if best[1] is not None:
        module.load_state_dict(best[1])
        out["kept_step"] = best[2]
    if held_out is not None:
        out["held_out_top1"] = teacher_forced_agreement(module, held_out)
    return out


@torch.no_grad()
def teacher_forced_agreement(module: DraftModule, examples: Examples, batch: int = 16) -> float:
    hit = n = 0
    device = module.embed.device
    module.eval()
    for i in range(0, len(examples), batch):
        tokens, rows, tgt_ids, _ = (
            x.to(device) for x in examples.batch(list(range(i, min(i + batch, len(examples)))))
        )
        pred = module(tokens).reshape(-1, module.vocab_map.shape[0])[rows].argmax(-1)
        hit += int((pred == tgt_ids[:, 0]).sum())
        n += len(rows)
    return hit / max(n, 1)


# -- evaluation -------------------------------------------------------------------------------


def simulate_tokens_per_round(agree: list[list[bool]], k: int) -> float:
    """Mean tokens per round of greedy speculation at block k along each sequence.

    agree[s][j]: the draft's argmax equals the target's at answer position j of sequence s
    (teacher-forced on the target's own greedy continuation, which is what greedy
    speculation commits).
    """
    tokens = rounds = 0
    for row in agree:
        j = 0
        while j < len(row):
            run = 0
            while run < k and j + run < len(row) and row[j + run]:
                run += 1
            step = min(run + 1, len(row) - j)
            tokens += step
            rounds += 1
            j += step
    return tokens / max(rounds, 1)


def measure_cost_ratio(draft_engine: LlamaEngine, target_engine: LlamaEngine, reps: int = 15,
                       context: int = 128) -> dict:
    """Median ms of a one-token draft step, a one-token target step and a 5-token verify pass.

    The three are measured interleaved, rep by rep, so machine drift hits them alike.
    """
    prompt = torch.arange(context) % 1000 + 10
    d_cache, t_cache = draft_engine.new_cache(), target_engine.new_cache()
    draft_engine.forward([d_cache], [prompt], [1])
    target_engine.forward([t_cache], [prompt], [1])

    def timed(engine, cache, n):
        return engine.timed_forward(cache, context, torch.arange(n) + 100)

    for _ in range(2):  # warm-up
        timed(draft_engine, d_cache, 1), timed(target_engine, t_cache, 1)
        timed(target_engine, t_cache, 5)
    d, t, t5 = [], [], []
    for _ in range(reps):
        d.append(timed(draft_engine, d_cache, 1))
        t.append(timed(target_engine, t_cache, 1))
        t5.append(timed(target_engine, t_cache, 5))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    d_ms, t_ms, t5_ms = med(d), med(t), med(t5)
    return {"draft_ms": d_ms, "target_ms": t_ms, "cost_ratio": d_ms / t_ms, "target_5_ms": t5_ms,
            "verify5_over_1": t5_ms / t_ms}


def evaluate(draft_dir: str, held_out: list[dict], threads: int = 1) -> dict:
    """Held-out figures of a draft: acceptance, tokens per round k=1..8, cost, speedups."""
    from specdec.models.loading import load_engine

    torch.set_num_threads(threads)
    meta = draft_model.read_meta(draft_dir)
    d_engine, _, _ = load_engine(draft_dir, torch.device("cpu"))
    t_engine, _, _ = load_engine(meta["target"], torch.device("cpu"))
    agree_rows = []
    for r in held_out:
        prompt, answer = r["prompt"].long(), r["answer"].long()
        cache = d_engine.new_cache()
        seq = torch.cat([prompt, answer])
        logits = d_engine.forward([cache], [seq[:-1]], [len(answer)])[0]  # [answer, vocab_out]
        pred = d_engine.token_ids(logits.argmax(-1))
        target_greedy = r["top_ids"][:, 0].long()  # the target's argmax at each answer position
        agree_rows.append((pred == target_greedy).tolist())
    n = sum(len(a) for a in agree_rows)
    acceptance = sum(sum(a) for a in agree_rows) / max(n, 1)
    tpr = {k: simulate_tokens_per_round(agree_rows, k) for k in range(1, 9)}
    cost = measure_cost_ratio(d_engine, t_engine)
    c, v5 = cost["cost_ratio"], cost["verify5_over_1"]
    # Predicted speedups over target-only at k = 4 (verify of 5 tokens costs v5 target steps):
    seq_speedup = tpr[4] / (4 * c + v5)
    pipe_speedup = tpr[4] / max(v5, 5 * c)
    return {
        "held_out_tokens": n,
        "greedy_acceptance": round(acceptance, 4),
        "tokens_per_round": {str(k): round(v, 3) for k, v in tpr.items()},
        "cost": {k: round(v, 3) for k, v in cost.items()},
        "predicted_speedup_k4": {"sequential": round(seq_speedup, 3),
                                 "pipelined_upper_bound": round(pipe_speedup, 3)},
    }
