"""``specdec bench-gpu``: the engine's step costs on the device present (issue 37).

Measured with the device synchronised around every timing (``specdec.serving.kernels.timed``),
after ``--context`` tokens of cache:

- the target's forward over m rows of one session, m = 1 .. k + 1: T(1) is a target-only step,
  T(k + 1) a verify pass, and (T(k + 1) - T(1)) / k what each verified row adds;
- the draft's one-row step D(1);
- the weight-bandwidth bound of a one-row target step: the target's weight bytes over the
  device's copy bandwidth (bytes read + written per second by a device-to-device copy; every
  weight is read once per step), beside the measured T(1);
- a model, not a measurement, of spec decoding's tokens/s at a few acceptance rates:
  (1 - a^(k+1)) / (1 - a) tokens per round of k D(1) + T(k + 1).

Models: ``--tiny`` (random tiny Llamas, seconds on a CPU: what CI runs), ``--shape 8b``
(random-weight Llama 3.1 8B-shaped target and a Llama 3.2 1B-shaped draft, built on the device in
``--dtype``: ~16 + 2.5 GB of bf16), or ``--target`` / ``--draft`` model specs. Writes a JSON
file and prints a table. What has and has not been measured on a GPU: docs/gpu.md.
"""

from __future__ import annotations

import json
import pathlib
import statistics

import torch

from specdec.config import DEFAULT_DTYPE, DTYPES
from specdec.serving.arch import ArchConfig
from specdec.serving.kernels import timed

# Llama 3.1 8B and Llama 3.2 1B (untied here: the bound counts the head's bytes either way).
SHAPES = {
    "8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab=128256),
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               intermediate_size=8192, vocab=128256),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab=512),
    "tiny-draft": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=16, intermediate_size=64, vocab=512),
}
ACCEPTANCE = (0.5, 0.7, 0.9)


def register(sub) -> None:
    g = sub.add_parser("bench-gpu", help="target / draft step costs on this machine's device "
                                         "(GPU if present), against the bandwidth bound")
    g.add_argument("--tiny", action="store_true",
                   help="random tiny models (runs on CPU in seconds; what the tests run)")
    g.add_argument("--shape", choices=("8b",), help="random-weight 8B-shaped target with a "
                                                    "1B-shaped draft, built on the device")
    g.add_argument("--target", default="default", help="model spec (without --tiny/--shape)")
    g.add_argument("--draft", default="default-draft", help="model spec (likewise)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    g.add_argument("--k", type=int, default=8, help="draft tokens per round: rows 1 .. k + 1")
    g.add_argument("--context", type=int, default=256, help="cached tokens before each step")
    g.add_argument("--reps", type=int, default=10, help="timings per row count (median)")
    g.add_argument("--out", default="bench/out/gpu.json")
    g.set_defaults(func=cmd_bench_gpu)


def random_engine(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A LlamaEngine of a named shape with random weights made on the device (no checkpoint
    and no host copy: an 8B shape needs its bf16 bytes of device memory and nothing more)."""
    from specdec.serving.engine import LlamaEngine

    s = dict(SHAPES[shape])
    vocab = s.pop("vocab")
    arch = ArchConfig(**s, rms_norm_eps=1e-5, rope_theta=5e5, max_context=8192)
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * h ** -0.5).to(dtype)

    weights = {"embed": rand(vocab, h), "norm": torch.ones(h, device=device, dtype=dtype),
               "head": rand(vocab, h)}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        weights.update({p + "attn_norm": torch.ones(h, device=device, dtype=dtype),
                        p + "mlp_norm": torch.ones(h, device=device, dtype=dtype),
                        p + "wqkv": rand(qkv, h), p + "wo": rand(h, arch.num_heads * d),
                        p + "w_gate_up": rand(2 * inter, h), p + "w_down": rand(h, inter)})
    kernels = "mkl" if device.type == "cpu" else "auto"  # (no kernel timing at start)
    return LlamaEngine(arch, weights, device, kernels, dtype=dtype)


def weight_bytes(engine) -> int:
    """Bytes a one-row forward reads: every linear layer's weight and the norms (the
    embedding reads one row)."""
    tensors = [engine.norm, engine.head.plain]
    for layer in engine.layers:
        tensors += [v.plain if hasattr(v, "plain") else v for v in layer.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes per second a device-to-device copy of ``nbytes`` moves (read + written: the
    memory's total rate, which a weight-reading step approaches), median of reps."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    ms = statistics.median(timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * nbytes / (ms / 1000.0)


def step_costs(engine, context: int, max_rows: int, reps: int) -> dict[int, float]:
    """{rows: median ms of one forward over that many rows of one session}."""
    ms = engine.forward_timer(context=context, max_rows=max_rows)
    for m in range(1, max_rows + 1):  # warm every shape (allocator, kernels)
        ms(m)
    return {m: statistics.median(ms(m) for _ in range(reps)) for m in range(1, max_rows + 1)}


def spec_model(target_ms: dict[int, float], draft_ms: float, k: int) -> dict[str, float]:
    """Tokens/s of target-only and (modelled) spec decoding at ACCEPTANCE rates."""
    out = {"target_only": 1000.0 / target_ms[1]}
    for a in ACCEPTANCE:
        tokens = (1 - a ** (k + 1)) / (1 - a)  # expected tokens per round, bonus included
        out[f"spec_a{a}"] = 1000.0 * tokens / (k * draft_ms + target_ms[k + 1])
    return out


def _engines(args, device: torch.device, dtype: torch.dtype):
    if args.tiny:
        return random_engine("tiny", device, dtype), random_engine("tiny-draft", device, dtype,
                                                                    seed=1), "tiny", "tiny-draft"
    if args.shape:
        return (random_engine(args.shape, device, dtype), random_engine("1b", device, dtype, 1),
                args.shape, "1b")
    from specdec.models.loading import load_engine, resolve_draft_spec

    target = load_engine(args.target, device, "auto", dtype=dtype)[0]
    draft = load_engine(resolve_draft_spec(args.draft, args.target), device, "auto",
                        dtype=dtype)[0]
    return target, draft, args.target, args.draft


def run(args) -> dict:
    from specdec.models.hub import pick_device, pick_dtype

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    target, draft, target_name, draft_name = _engines(args, device, dtype)
    context = min(args.context, target.arch.max_context - args.k - 2)
    target_ms = step_costs(target, context, args.k + 1, args.reps)
    draft_ms = step_costs(draft, context, 1, args.reps)[1]
    nbytes = weight_bytes(target)
    bandwidth = copy_bandwidth(device, min(nbytes, 1 << 30) if device.type != "cpu"
                               else min(nbytes, 64 << 20))
    report = dict(
        device=str(device), device_name=torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu", dtype=str(dtype).replace("torch.", ""),
        target=target_name, draft=draft_name, k=args.k, context=context, reps=args.reps,
        target_ms={str(m): v for m, v in target_ms.items()}, draft_ms=draft_ms,
        verify_ms_per_row=(target_ms[args.k + 1] - target_ms[1]) / args.k,
        target_weight_bytes=nbytes, copy_bandwidth_gbs=bandwidth / 1e9,
        bound_ms=nbytes / bandwidth * 1000.0,  # each weight byte read once, at the copy's rate
        tokens_per_s=spec_model(target_ms, draft_ms, args.k),
    )
    report["bound_fraction"] = report["bound_ms"] / target_ms[1]
    if device.type == "cuda":
        report["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return report


def table(r: dict) -> str:
    rows = [f"{r['device_name']} ({r['device']}), {r['dtype']}: target {r['target']}, "
            f"draft {r['draft']}, context {r['context']}",
            f"{'rows':>5} {'target ms':>10}"]
    rows += [f"{m:>5} {v:>10.3f}" for m, v in r["target_ms"].items()]
    rows += [f"verify cost per row {r['verify_ms_per_row']:.3f} ms; draft step "
             f"{r['draft_ms']:.3f} ms",
             f"weight-bandwidth bound of T(1): {r['bound_ms']:.3f} ms "
             f"({r['target_weight_bytes'] / 1e6:.1f} MB at {r['copy_bandwidth_gbs']:.0f} GB/s); "
             f"T(1) is {r['bound_fraction']:.2f} of the bound",
             "tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["tokens_per_s"].items())
             + " (spec: modelled from the costs, k = %d)" % r["k"]]
    return "\n".join(rows)


def cmd_bench_gpu(args) -> int:
    if args.tiny and args.shape:
        raise SystemExit("error: --tiny and --shape are alternatives")
    try:
        report = run(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {out}")
    return 0
