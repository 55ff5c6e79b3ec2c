"""``specdec bench --concurrency``: throughput and latency as concurrent requests grow.

For each level N, N clients send requests at once, each its next one when its answer arrives
(a closed loop, ``--requests-per-client`` each), so N requests are in flight the whole run but
for the last ones' drain. specdec serves them concurrently (the target batches their verify
work, the draft their drafting); HF ``generate`` serves N requests one at a time, so its
requests queue. Reported: aggregate tokens/s, per-request latency (p50/p95, from a request's
submission to its last token), what specdec's rounds did, and whether every greedy answer
equals HF target-only's.
"""

from __future__ import annotations

import asyncio
import statistics
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
               k: int | None, per_client: int = 3, repeats: int = 1) -> dict:
    """Each level N: specdec serves N clients at once, each sending its next request when its
    answer arrives (a closed loop, as vLLM's ``benchmark_serving --max-concurrency``), for
    ``per_client`` requests each, so N requests are in flight until the last ones drain; HF
    serves N requests one at a time. Every answer is checked against HF target-only's (specdec
    target-only's where the target computes integer numerics).

    ``repeats`` > 1 runs the whole sweep that many times, the specdec systems in a rotated
    order each time (HF, the reference, is timed in the first sweep only): each row then gives
    the median over the sweeps and their range, and its ratio to specdec target-only is the
    median of the ratios within each sweep (runs minutes apart, so machine drift cancels)."""
    specdec = list(SYSTEMS[1:])
    reference: dict[int, list[int]] = {}
    if spd.reference != "hf":  # specdec's own target's text, not HF's float32
        for i, ids in enumerate(tqdm(prompt_ids, desc="reference (target-only)", unit="prompt")):
            reference[i] = spd.run(spd.reference, ids, max_new, None).token_ids
    runs = []
    total = sum(n * (1 + per_client * len(specdec) * repeats) for n in levels)
    with tqdm(total=total, desc="concurrency", unit="req") as bar:
        for rep in range(repeats):
            order = specdec[rep % len(specdec):] + specdec[: rep % len(specdec)]
            for n in levels:
                for system in (["hf"] if rep == 0 else []) + order:
                    row = _run_level(system, n, prompt_ids, max_new, hf, spd, k, per_client,
                                     reference, bar)
                    runs.append(dict(row, repeat=rep))
    return {"rows": _aggregate(runs), "runs": [{k: v for k, v in r.items() if k != "stats"}
                                               for r in runs],
            "levels": levels, "per_client": per_client, "repeats": repeats,
            "reference": spd.reference}


def _run_level(system: str, n: int, prompt_ids: list[list[int]], max_new: int, hf, spd,
               k: int | None, per_client: int, reference: dict, bar) -> dict:
    """One system at one level: its aggregate throughput, latencies and round stats."""
    from bench.harness import SPECDEC_RUNS
    from orchestrator.generation import GenerationRequest

    def prompt(i: int) -> list[int]:
        return prompt_ids[i % len(prompt_ids)]

    latencies, outputs, stats = [], [], []
    t0 = time.perf_counter()
    if system == "hf":
        for i in range(n):  # one at a time: later requests wait for earlier ones
            tokens, _ = hf.run("hf", prompt(i), max_new)
            latencies.append(time.perf_counter() - t0)
            outputs.append(tokens)
            reference.setdefault(i % len(prompt_ids), tokens)
            bar.update(1)
    else:
        orch_name, mode, branches = SPECDEC_RUNS[system]
        orch = spd.orchestrators[(orch_name, spd.rtts[0])]
        results: dict[int, tuple] = {}
        queue = iter(range(n * per_client))

        async def client():
            for i in queue:  # the shared queue: whoever is free takes the next
                sent = time.perf_counter()
                r = await orch.generate(GenerationRequest(
                    prompt(i), max_new, mode=mode, k=k, branches=branches))
                results[i] = (r, time.perf_counter() - sent)
                bar.update(1)

        async def all_of():
            await asyncio.gather(*(client() for _ in range(n)))

        spd.loop.run_until_complete(all_of())
        for i in sorted(results):
            result, latency = results[i]
            latencies.append(latency)
            outputs.append(result.token_ids)
            stats.append(result.stats)
    wall = time.perf_counter() - t0

    def differs(i: int, out: list[int]) -> bool:
        key = i % len(prompt_ids)
        if key not in reference:  # (untimed: outside every measured run)
            reference[key] = hf.run("hf", prompt(i), max_new)[0]
        return out != reference[key]

    tokens = sum(len(o) for o in outputs)
    return dict(system=system, concurrency=n, requests=len(outputs), tokens=tokens,
                wall_s=wall, tokens_per_s=tokens / wall, p50_s=_percentile(latencies, 0.5),
                p95_s=_percentile(latencies, 0.95),
                mismatches=0 if system == "hf" and spd.reference != "hf"  # (not checked)
                else sum(differs(i, out) for i, out in enumerate(outputs)),
                stats=stats, **_round_stats(stats))


def _aggregate(runs: list[dict]) -> list[dict]:
    """One row per (system, N) over the sweeps: median throughput and latency, their range,
    the median within-sweep ratio to specdec target-only, and the round stats of every
    request together."""
    alone = {(r["repeat"], r["concurrency"]): r["tokens_per_s"] for r in runs
             if r["system"] == "specdec-target-only"}
    rows = []
    keys = list(dict.fromkeys((r["system"], r["concurrency"]) for r in runs))
    for system, n in keys:
        rs = [r for r in runs if (r["system"], r["concurrency"]) == (system, n)]
        tps = [r["tokens_per_s"] for r in rs]
        ratios = [r["tokens_per_s"] / alone[(r["repeat"], n)] for r in rs
                  if (r["repeat"], n) in alone]
        stats = [s for r in rs for s in r["stats"]]
        rows.append(dict(
            system=system, concurrency=n, repeats=len(rs), requests=rs[0]["requests"],
            tokens=sum(r["tokens"] for r in rs), tokens_per_s=statistics.median(tps),
            tokens_per_s_range=[min(tps), max(tps)],
            vs_target_only=statistics.median(ratios) if ratios else None,
            vs_target_only_range=[min(ratios), max(ratios)] if ratios else None,
            p50_s=statistics.median(r["p50_s"] for r in rs),
            p95_s=statistics.median(r["p95_s"] for r in rs),
            mismatches=sum(r["mismatches"] for r in rs), **_round_stats(stats)))
    return rows


def _round_stats(stats: list) -> dict:
    """What specdec's rounds did at this level, over every request (empty for HF)."""
    rounds = sum(s.rounds for s in stats)
    if not rounds:
        return {}
    drafted = sum(s.num_drafts for s in stats)
    verdicts = sum(s.pipeline_hits + s.pipeline_misses for s in stats)
    return dict(rounds=rounds, tokens_per_round=sum(sum(s.tokens_per_round) for s in stats) /
                rounds, drafted_rounds=drafted / rounds,
                crowded_rounds=sum(s.crowded_rounds for s in stats) / rounds,
                cache_hit_rate=sum(s.pipeline_hits for s in stats) / verdicts if verdicts
                else None)


def table(summary: dict) -> str:
    """The rows as a markdown table; with several sweeps, medians and [min-max] ranges."""
    base = {r["system"]: r["tokens_per_s"] for r in summary["rows"] if r["concurrency"] == 1}
    lines = ["| system | N | aggregate tok/s | vs N=1 | vs specdec-target-only | p50 latency s | "
             "p95 latency s | tokens/round | drafted rounds | mismatches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        rel = _num(r["tokens_per_s"] / base[r["system"]], "x") if base.get(r["system"]) else "-"
        tps, vs = f"{r['tokens_per_s']:.1f}", "-"
        if r["repeats"] > 1:
            tps += " [{:.1f}-{:.1f}]".format(*r["tokens_per_s_range"])
        if r.get("vs_target_only") is not None:
            vs = f"{r['vs_target_only']:.2f}x"
            if r["repeats"] > 1:
                vs += " [{:.2f}-{:.2f}]".format(*r["vs_target_only_range"])
        lines.append(f"| {r['system']} | {r['concurrency']} | {tps} | {rel} | {vs} | "
                     f"{r['p50_s']:.2f} | {r['p95_s']:.2f} | "
                     f"{_num(r.get('tokens_per_round'))} | {_num(r.get('drafted_rounds'))} | "
                     f"{r['mismatches']} |")
    return "\n".join(lines)


def _num(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def plot(summary: dict, out) -> object:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        rs = [r for r in summary["rows"] if r["system"] == system]
        ns = [r["concurrency"] for r in rs]
        tps = [r["tokens_per_s"] for r in rs]
        spread = [[t - r["tokens_per_s_range"][0] for t, r in zip(tps, rs)],
                  [r["tokens_per_s_range"][1] - t for t, r in zip(tps, rs)]]
        a.errorbar(ns, tps, yerr=spread, marker="o", capsize=3, label=system)
        b.plot(ns, [r["p50_s"] for r in rs], marker="o", label=f"{system} p50")
        b.plot(ns, [r["p95_s"] for r in rs], marker="x", linestyle="--", label=f"{system} p95")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
    a.set_ylabel("aggregate tokens / s (median, bars: range over sweeps)")
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
