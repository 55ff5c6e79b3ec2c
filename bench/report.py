"""Summaries, the results table and the plots of ``specdec bench``."""

from __future__ import annotations

import collections
import pathlib

from bench.llamacpp import agreement
from orchestrator.adaptive import expected_tokens

SPEC_SYSTEMS = ("specdec-spec", "specdec-pipelined", "specdec-ngram")
# Systems whose numerics are not transformers' float32 (llama.cpp's 8-bit activations): their
# greedy text is compared with HF's as agreement, not counted as a mismatch.
OWN_NUMERICS = ("llamacpp", "llamacpp-prompt-lookup")


def summarize(runs, systems: list[str], sets: list[str], target_ms: list[float],
              reference: str = "hf") -> dict:
    """Speeds against HF's, and the runs whose token ids differ from ``reference``'s: HF's
    where specdec computes transformers' float32, "specdec-target-only" where its target runs
    integer numerics (then every system's text is compared with HF's as agreement)."""
    by = collections.defaultdict(list)
    for r in runs:
        by[(r.system, r.prompt_set)].append(r)
    ref = {(r.prompt_set, r.prompt_index): r.token_ids for r in runs if r.system == reference}
    hf = {(r.prompt_set, r.prompt_index): r.token_ids for r in runs if r.system == "hf"}
    own = set(OWN_NUMERICS) | ({s for s in systems if s.startswith("specdec")}
                               if reference != "hf" else set())
    mismatches = [
        (r.system, r.prompt_set, r.prompt_index) for r in runs
        if r.system not in ("hf", reference, *OWN_NUMERICS)
        and r.token_ids != ref.get((r.prompt_set, r.prompt_index))
    ]
    rows = []
    for s in sets:
        base = by[("hf", s)]
        base_tps = sum(len(r.token_ids) for r in base) / max(sum(r.wall_s for r in base), 1e-9)
        for system in systems:
            rs = by[(system, s)]
            if not rs:
                continue
            tokens = sum(len(r.token_ids) for r in rs)
            wall = sum(r.wall_s for r in rs)
            tps = tokens / max(wall, 1e-9)
            per_prompt = [
                (len(r.token_ids) / r.wall_s) / (len(b.token_ids) / b.wall_s)
                for r, b in zip(rs, base) if r.wall_s and b.wall_s and b.token_ids
            ]
            row = dict(system=system, prompt_set=s, prompts=len(rs), tokens=tokens,
                       tokens_per_s=tps, speedup=tps / base_tps,
                       min_prompt_speedup=min(per_prompt) if per_prompt else None)
            if system in own:  # tokens before the first difference from HF's
                row["agreement_with_hf"] = sum(
                    agreement(r.token_ids, hf.get((s, r.prompt_index), [])) for r in rs
                ) / max(sum(len(hf.get((s, r.prompt_index), [])) for r in rs), 1)
            drafted = sum(r.draft_tokens for r in rs)
            rounds = sum(r.rounds for r in rs)
            if rounds:
                a = sum(r.accepted_tokens for r in rs) / drafted if drafted else 0.0
                k_mean = sum(r.k_mean * r.rounds for r in rs) / rounds
                hits = sum(r.pipeline_hits for r in rs)
                tries = hits + sum(r.pipeline_misses for r in rs)
                row.update(
                    cache_hit_rate=hits / tries if tries else None,
                    branches_per_round=sum(r.branches for r in rs) / rounds,
                    acceptance=a,
                    tokens_per_round=sum(sum(r.tokens_per_round) for r in rs) / rounds,
                    k_mean=k_mean,
                    overlap_efficiency=sum(r.draft_busy_s + r.verify_busy_s for r in rs) / wall,
                )
                k = max(0, round(k_mean))
                if target_ms and k < len(target_ms):
                    # best possible with the draft fully hidden: E[tokens/round] / T_verify(k+1)
                    row["bound_tokens_per_s"] = 1000.0 * expected_tokens(a, k) / target_ms[k]
            rows.append(row)
    return {"rows": rows, "mismatches": mismatches, "target_forward_ms": target_ms,
            "reference": reference}


def bound_line(bound: dict, target_ms: list[float]) -> str:
    """The weight-streaming bound of a one-token step beside the target's measured T(1)."""
    parts = [f"{t} thread{'s' if t > 1 else ''}: read {b['read_gbs']:.1f} GB/s, bound "
             f"{b['bound_ms']:.1f} ms" for t, b in bound.items() if t != "weight_mb"]
    measured = f"; measured T(1) in service {target_ms[0]:.1f} ms" if target_ms else ""
    return (f"weight-streaming bound ({bound['weight_mb']:.0f} MB of weights a step): "
            + "; ".join(parts) + measured)


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def table(summary: dict) -> str:
    head = ("| set | system | tok/s | speedup vs HF | worst prompt | acceptance | tokens/round | "
            "k mean | overlap eff. | pipeline hit rate | bound tok/s |")
    lines = [head, "|" + "---|" * 11]
    for r in summary["rows"]:
        name = r["system"]
        if "agreement_with_hf" in r:  # own numerics: how much of HF's greedy text it wrote
            name += f" (agrees on {r['agreement_with_hf']:.0%})"
        lines.append(
            f"| {r['prompt_set']} | {name} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {_fmt(r.get('min_prompt_speedup'))} | "
            f"{_fmt(r.get('acceptance'))} | {_fmt(r.get('tokens_per_round'))} | "
            f"{_fmt(r.get('k_mean'))} | {_fmt(r.get('overlap_efficiency'))} | "
            f"{_fmt(r.get('cache_hit_rate'))} | {_fmt(r.get('bound_tokens_per_s'), '.1f')} |"
        )
    return "\n".join(lines)


def plots(runs, summary: dict, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rows = summary["rows"]
    sets = sorted({r["prompt_set"] for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(sets), 1)
    for j, s in enumerate(sets):
        vals = [next((r["tokens_per_s"] for r in rows if r["system"] == sy and r["prompt_set"] == s), 0)
                for sy in systems]
        ax.bar([i + j * width for i in range(len(systems))], vals, width, label=s)
    ax.set_xticks([i + width * (len(sets) - 1) / 2 for i in range(len(systems))])
    ax.set_xticklabels(systems, rotation=25, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title("Greedy decoding speed per system (interleaved runs)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for system in SPEC_SYSTEMS:
        tpr = [t for r in runs if r.system == system for t in r.tokens_per_round]
        if tpr:
            ax.hist(tpr, bins=range(1, max(tpr) + 2), alpha=0.5, label=system, align="left")
    ax.set_xlabel("tokens emitted per round")
    ax.set_ylabel("rounds")
    ax.set_title("Tokens per round")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "tokens_per_round.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    pipelined = [r for r in runs if r.system == "specdec-pipelined" and r.timeline]
    if pipelined:
        r = max(pipelined, key=lambda r: r.rounds)
        fig, ax = plt.subplots(figsize=(11, 2.8))
        colors = {"draft": "tab:orange", "target": "tab:blue"}
        end = 0.0
        for service, s, e, outcome in r.timeline:
            y = 1 if service == "draft" else 0
            ax.barh(y, max(e - s, 0.0005), left=s, color=colors[service],
                    alpha=0.4 if outcome != "ok" else 0.9, edgecolor="black", linewidth=0.3)
            end = max(end, e)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["target verify", "draft propose"])
        ax.set_xlim(0, min(end, 2.0))
        ax.set_xlabel("seconds since the first call (first 2 s)")
        ax.set_title(f"Pipelined timeline ({r.prompt_set} prompt {r.prompt_index}): "
                     "drafting overlaps verification")
        fig.tight_layout()
        paths.append(out / "timeline.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def plot_verify_cost(med: dict, out: pathlib.Path) -> pathlib.Path:
    """T(m) of each kernel choice: in ms (left) and over its own T(1) (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ms, ax_rel) = plt.subplots(1, 2, figsize=(11, 4))
    for name, d in med.items():
        ms = sorted(d)
        ax_ms.plot(ms, [d[m] for m in ms], marker="o", label=name)
        ax_rel.plot(ms, [d[m] / d[1] for m in ms], marker="o", label=name)
    ax_ms.set_ylabel("ms per forward")
    ax_ms.set_title("Verify-pass cost")
    ax_rel.axhline(1.2, color="gray", linestyle="--", linewidth=0.8, label="T(5)/T(1) = 1.2")
    ax_rel.set_ylabel("T(m) / T(1)")
    ax_rel.set_title("Relative to one token")
    for ax in (ax_ms, ax_rel):
        ax.set_xlabel("tokens in the forward pass (m)")
        ax.legend()
    fig.tight_layout()
    path = out / "verify_cost.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
