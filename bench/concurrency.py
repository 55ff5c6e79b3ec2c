"""``specdec bench --concurrency``: throughput and latency as concurrent requests grow.

For each level N, N requests start together. specdec serves them concurrently (the target
batches their verify work, the draft their drafting); HF ``generate`` serves one request at a
time, so its requests queue. Reported: aggregate tokens/s and per-request latency (p50/p95,
from submission to the last token), and whether every greedy answer equals HF target-only's.
"""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

# specdec-spec is what ``--mode auto`` runs on services sharing one machine's cores,
# specdec-pipelined what it runs on separate hardware (``--split``)
SYSTEMS = ("hf", "specdec-target-only", "specdec-spec", "specdec-pipelined")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def run_levels(levels: list[int], prompt_ids: list[list[int]], max_new: int, hf, spd,
               k: int | None) -> dict:
    from bench.harness import SPECDEC_RUNS
    from orchestrator.generation import GenerationRequest

    reference: dict[int, list[int]] = {}
    rows = []
    total = sum(levels) * len(SYSTEMS)
    with tqdm(total=total, desc="concurrency", unit="req") as bar:
        for n in levels:
            batch = [prompt_ids[i % len(prompt_ids)] for i in range(n)]
            for system in SYSTEMS:
                latencies, outputs = [], []
                t0 = time.perf_counter()
                if system == "hf":
                    for ids in batch:  # one at a time: later requests wait for earlier ones
                        tokens, _ = hf.run("hf", ids, max_new)
                        latencies.append(time.perf_counter() - t0)
                        outputs.append(tokens)
                        bar.update(1)
                else:
                    orch_name, mode, branches = SPECDEC_RUNS[system]
                    orch = spd.orchestrators[(orch_name, spd.rtts[0])]

                    async def one(ids):
                        r = await orch.generate(GenerationRequest(ids, max_new, mode=mode, k=k,
                                                                  branches=branches))
                        bar.update(1)
                        return r, time.perf_counter() - t0

                    async def all_of():
                        return await asyncio.gather(*(one(ids) for ids in batch))

                    for result, latency in spd.loop.run_until_complete(all_of()):
                        latencies.append(latency)
                        outputs.append(result.token_ids)
                wall = time.perf_counter() - t0
                for i, out in enumerate(outputs):
                    key = i % len(prompt_ids)
                    if system == "hf":
                        reference.setdefault(key, out)
                mismatches = sum(
                    out != reference.get(i % len(prompt_ids)) for i, out in enumerate(outputs))
                tokens = sum(len(o) for o in outputs)
                rows.append(dict(system=system, concurrency=n, tokens=tokens, wall_s=wall,
                                 tokens_per_s=tokens / wall, p50_s=_percentile(latencies, 0.5),
                                 p95_s=_percentile(latencies, 0.95), mismatches=mismatches))
    return {"rows": rows, "levels": levels}


def table(summary: dict) -> str:
    base = {r["system"]: r["tokens_per_s"] for r in summary["rows"] if r["concurrency"] == 1}
    alone = {r["concurrency"]: r["tokens_per_s"] for r in summary["rows"]
             if r["system"] == "specdec-target-only"}
    lines = ["| system | N | aggregate tok/s | vs N=1 | vs specdec-target-only | p50 latency s | "
             "p95 latency s | mismatches |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        rel = r["tokens_per_s"] / base[r["system"]] if base.get(r["system"]) else float("nan")
        vs = r["tokens_per_s"] / alone[r["concurrency"]] if alone.get(r["concurrency"]) else \
            float("nan")
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{rel:.2f}x | {vs:.2f}x | {r['p50_s']:.2f} | {r['p95_s']:.2f} | "
                     f"{r['mismatches']} |")
    return "\n".join(lines)


def plot(summary: dict, out) -> object:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        rs = [r for r in summary["rows"] if r["system"] == system]
        ns = [r["concurrency"] for r in rs]
        a.plot(ns, [r["tokens_per_s"] for r in rs], marker="o", label=system)
        b.plot(ns, [r["p50_s"] for r in rs], marker="o", label=f"{system} p50")
        b.plot(ns, [r["p95_s"] for r in rs], marker="x", linestyle="--", label=f"{system} p95")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
    a.set_ylabel("aggregate tokens / s")
    a.set_title("Throughput")
    b.set_ylabel("request latency (s)")
    b.set_title("Latency")
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    path = out / "concurrency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
