"""Experiment (issue 33, docs/draft.md): the shipped plain draft + the target's feature added to
its input through a zero-initialised projection, so training starts at the shipped draft.

Row at sequence position P+i (answer token i) gets embed(answer[i]) + W n(features[i]);
pass-2 rows get no feature (the target has not computed it yet) and see the true rows before
them. Data: `specdec distill --features --data-only` shards and the held-out sets with features.

    python bench/draft_fused.py OUT [THREADS] [STEPS] [input|both] [BASE_LR] \
        [--data runs/eagle/data] (held-out sets: runs/eagle/heldout-*)
"""
import json, math, random, sys, pathlib
import torch, torch.nn as nn, torch.nn.functional as F
from tqdm import tqdm
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from specdec.models import draft_model as dm
from specdec.distill.train import init_from_draft, soft_target_loss
from specdec.distill.feature_draft import load_records, shard_paths

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
OUT = pathlib.Path(sys.argv[1]); OUT.mkdir(exist_ok=True, parents=True)
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 300
INJECT = sys.argv[4] if len(sys.argv) > 4 else "input"   # input | both
BASE_LR = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-4

base, arch, vocab_map = init_from_draft(dm.shipped_draft_dir())
embed = base.embed
to_draft = torch.full((embed.shape[0],), -1, dtype=torch.long)
to_draft[vocab_map] = torch.arange(len(vocab_map))
H = arch.hidden_size
emb_rms = float(embed.pow(2).mean().sqrt())


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = base
        self.inj = nn.ModuleList([nn.Linear(H, H, bias=False) for _ in range(2 if INJECT == "both" else 1)])
        for l in self.inj:
            nn.init.zeros_(l.weight)

    def forward(self, tokens, feats, has, passes=2):
        """tokens [b,t], feats [b,t,H] (zeros where none), has [b,t] bool. Returns logits per pass."""
        a, p = arch, self.base.params
        b, t = tokens.shape
        nf = feats * torch.rsqrt(feats.pow(2).mean(-1, keepdim=True) + 1e-6) * emb_rms
        nf = nf * has[..., None]
        x1 = self.base.embed[tokens]
        xs = [x1 + self.inj[0](nf)]
        if passes == 2:
            xs.append(x1)  # pass 2: no feature at the row
        x = torch.cat(xs, 1)
        T = x.shape[1]
        pos = torch.arange(t).float().repeat(passes)
        ang = pos[:, None] * self.base.inv_freq[None]
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        if passes == 2:
            r = torch.arange(t)
            m11 = r[None] <= r[:, None]
            m21 = r[None] <= (r - 1)[:, None]
            m22 = r[None] == r[:, None]
            mask = torch.cat([torch.cat([m11, torch.zeros(t, t, dtype=torch.bool)], 1),
                              torch.cat([m21, m22], 1)], 0)
        else:
            mask = torch.ones(t, t, dtype=torch.bool).tril()

        def rope(v):
            v1, v2 = v.chunk(2, -1)
            return v * cos + torch.cat((-v2, v1), -1) * sin
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        for i in range(a.num_layers):
            if i == 1 and len(self.inj) > 1:
                x = x + torch.cat([self.inj[1](nf)] + ([torch.zeros_like(nf)] if passes == 2 else []), 1)
            pre = f"layers_{i}_"
            h = self.base._norm(x, p[pre + "attn_norm"])
            q, k, v = F.linear(h, p[pre + "wqkv"]).split([hq * d, hkv * d, hkv * d], -1)
            q = rope(q.view(b, T, hq, d).transpose(1, 2))
            k = rope(k.view(b, T, hkv, d).transpose(1, 2))
            v = v.view(b, T, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
            x = x + F.linear(o.transpose(1, 2).reshape(b, T, hq * d), p[pre + "wo"])
            h = self.base._norm(x, p[pre + "mlp_norm"])
            gate, up = F.linear(h, p[pre + "w_gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, p[pre + "w_down"])
        lg = F.linear(self.base._norm(x, p["norm"]), p["head"])
        return list(lg.split(t, 1))


def items_of(records, max_prompt=512):
    out = []
    for r in records:
        a = min(len(r["answer"]), 192)
        if a < 3:
            continue
        pr = r["prompt"][-max_prompt:].long()
        out.append(dict(prompt=pr, answer=r["answer"][:a].long(), feats=r["features"][:a].half(),
                        top_ids=to_draft[r["top_ids"][:a].long()], top_lp=r["top_logprobs"][:a].half()))
    return out


def batch_of(items):
    t = max(len(it["prompt"]) + len(it["answer"]) for it in items)
    b = len(items)
    tokens = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, H)
    has = torch.zeros(b, t, dtype=torch.bool)
    top_ids = torch.full((b, t, 32), -1, dtype=torch.long)
    top_lp = torch.zeros(b, t, 32)
    valid = torch.zeros(b, t, dtype=torch.bool)  # row predicts a token with a target
    for n, it in enumerate(items):
        P, A = len(it["prompt"]), len(it["answer"])
        tokens[n, :P] = it["prompt"]; tokens[n, P:P + A] = it["answer"]
        feats[n, P:P + A] = it["feats"].float(); has[n, P:P + A] = True
        # row P+i predicts answer[i+1]: target top at answer index i+1
        top_ids[n, P:P + A - 1] = it["top_ids"][1:A]; top_lp[n, P:P + A - 1] = it["top_lp"][1:A].float()
        valid[n, P:P + A - 1] = True
        # the last prompt row predicts answer[0] (its feature is features[0]'s... row P-1 has no feature input)
    return tokens, feats, has, top_ids, top_lp, valid


def losses(model, bt, passes=2):
    tokens, feats, has, top_ids, top_lp, valid = bt
    outs = model(tokens, feats, has, passes)
    res = []
    for s, lg in enumerate(outs):
        v = valid.clone()
        if s == 1:  # pass 2 row r needs row r-1 to be an answer row with a feature (chain start)
            v &= torch.cat([torch.zeros_like(has[:, :1]), has[:, :-1]], 1)
        v &= (top_ids >= 0).any(-1)
        rows = v.flatten().nonzero().squeeze(1)
        ce, top1 = soft_target_loss(lg, rows, top_ids.flatten(0, 1)[rows], top_lp.flatten(0, 1)[rows])
        res.append((ce, top1, len(rows)))
    return res


@torch.no_grad()
def evaluate(model, items, bs=8):
    model.eval()
    hits = [0, 0]; n = [0, 0]
    for i in range(0, len(items), bs):
        tokens, feats, has, top_ids, top_lp, valid = batch_of(items[i:i + bs])
        outs = model(tokens, feats, has, 2)
        tgt = top_ids[..., 0]
        ok1 = (outs[0].argmax(-1) == tgt) & valid & (tgt >= 0)
        v1 = valid
        hits[0] += int(ok1.sum()); n[0] += int(v1.sum())
        # step 2 at row r counted where step 1 at row r-1 agreed
        prev = torch.cat([torch.zeros_like(ok1[:, :1]), ok1[:, :-1]], 1)
        ok2 = (outs[1].argmax(-1) == tgt) & valid & prev & (tgt >= 0)
        hits[1] += int(ok2.sum()); n[1] += int((valid & prev).sum())
    model.train()
    return [round(hits[0] / n[0], 4), round(hits[1] / max(n[1], 1), 4)]


held = {d: items_of(load_records(shard_paths(f"runs/eagle/{d}")))
        for d in ("heldout-templated", "heldout-handwritten")}
train_items = items_of(load_records(shard_paths("runs/eagle/data")))
print("train items", len(train_items), "rows", sum(len(i["answer"]) for i in train_items), flush=True)
model = Fused()
res0 = {k: evaluate(model, v) for k, v in held.items()}
print("step 0 (shipped draft):", res0, flush=True)
opt = torch.optim.AdamW([{"params": model.inj.parameters(), "lr": 1e-3},
                         {"params": base.parameters(), "lr": BASE_LR}], betas=(0.9, 0.98))
lrs = [1e-3, BASE_LR]
rng = random.Random(0)
order = sorted(range(len(train_items)), key=lambda i: len(train_items[i]["prompt"]) + len(train_items[i]["answer"]))
batches = [order[i:i + 8] for i in range(0, len(order), 8)]
hist = [dict(step=0, **res0)]
bar = tqdm(range(STEPS))
pool = []
ema = None
for step in bar:
    if not pool:
        pool = batches[:]; rng.shuffle(pool)
    bt = batch_of([train_items[i] for i in pool.pop()])
    f = min(1, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / STEPS)))
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr * f
    r = losses(model, bt)
    loss = (r[0][0] + r[1][0]) / 2
    opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    t1 = [float(x[1]) for x in r]
    ema = t1 if ema is None else [0.95 * e + 0.05 * v for e, v in zip(ema, t1)]
    bar.set_postfix(top1=f"{ema[0]:.3f}/{ema[1]:.3f}")
    if (step + 1) % 100 == 0 or step + 1 == STEPS:
        res = {k: evaluate(model, v) for k, v in held.items()}
        print(step + 1, res, flush=True)
        hist.append(dict(step=step + 1, **res))
        torch.save(model.state_dict(), OUT / "model.pt")
(OUT / "hist.json").write_text(json.dumps(hist, indent=1))
