"""Exactness benchmarks: ``specdec bench-rules`` and ``specdec bench-divergence``.

``bench-divergence`` runs every prompt target-only, spec and pipelined (greedy, and sampled
under the coupled rule with a seed per prompt), counts the outputs that differ from
target-only's, and reports the smallest margins by which the target's choices along the
target-only outputs were made (a text can only differ where a margin is within rounding).

``bench-rules``: the two sampling rules' acceptance on a draft/target pair.

Along the target's own sampled continuation of each prompt (teacher forcing: the target and the
draft each score the whole sequence in one pass), at every position with the target's p and the
draft's q (the draft service's q: the request's processing plus its 64-token truncation):

- rejection: the expected acceptance of a draft token is sum_t min(p_t, q_t) = 1 - TV(p, q);
- coupled: P(argmax p/E == argmax q/E) over the shared noise E, estimated with ``--noise-draws``
  independent noise vectors per position (specdec.serving.sampling.coupled_choice, as the services run
  it); its guaranteed floor (1 - TV) / (1 + TV) is printed beside it.

Tokens per round at k follow from the per-position acceptances along the path: a round started
at position n emits 1 + sum_{j=1..k} prod_{i<j} a_{n+i} tokens when acceptances are independent.
"""

from __future__ import annotations

import json
import pathlib

from orchestrator.generation import DECODE_ON


def register(sub) -> None:
    r = sub.add_parser("bench-rules", help="acceptance of the coupled and rejection sampling "
                       "rules on a draft/target pair")
    r.add_argument("--prompts", nargs="+", default=["default"],
                   help="prompt sets (default, grounded) or files (.jsonl / .txt)")
    r.add_argument("--limit", type=int, default=8, help="first N prompts of each set (0 = all)")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    r.add_argument("--noise-draws", type=int, default=64,
                   help="noise vectors per position for the coupled rule's estimate")
    r.add_argument("--k", type=int, nargs="+", default=[2, 4, 8],
                   help="block sizes to report expected tokens per round for")
    r.add_argument("--target", default="default")
    r.add_argument("--draft", default="default-draft")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--e2e", action="store_true",
                   help="also generate every prompt through local services with each rule "
                        "(spec and pipelined, interleaved with target-only): tok/s, acceptance, "
                        "and whether the coupled rule's text is the same in every mode")
    r.add_argument("--threads", type=int, default=0, help="torch threads per service (--e2e)")
    r.add_argument("--decode-on", type=int, default=DECODE_ON, metavar="N",
                   help="(--e2e) plain target steps per call in rounds with no block")
    r.add_argument("--out", default="bench/out")
    r.set_defaults(func=cmd_bench_rules)


def _prompts(args) -> list:
    """The first --limit prompts of each set in --prompts."""
    from bench.harness import load_prompts

    return [p for name in args.prompts for p in load_prompts(name)[: args.limit or None]]


def _write(out_dir: str, name: str, report: dict) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(report, indent=1))
    print(f"wrote {out / name}")


def _draft_params(params, q_top_k: int):
    """The draft service's q: the request's processing, truncated to its q_top_k tokens."""
    top_k = min(params.top_k, q_top_k) if params.top_k else q_top_k
    return params.replace(top_k=top_k)


def tokens_per_round(acc, k: int) -> float:
    """Mean over start positions n of 1 + sum_{j=1..k} prod_{i<j} acc[n + i]."""
    n = len(acc) - k
    if n <= 0:
        return float("nan")
    total = 0.0
    for start in range(n):
        run = 1.0
        emitted = 1.0
        for i in range(k):
            run *= acc[start + i]
            emitted += run
        total += emitted
    return total / n


def rule_acceptance(target, draft, vocab_size: int, prompt_ids: list[int], params,
                    max_new: int, noise_draws: int, q_top_k: int = 64) -> dict:
    """Per-position acceptances of both rules along the target's coupled sample."""
    import torch

    from specdec.serving.sampling import coupled_choice, process_logits

    cache = target.new_cache()
    seq = list(prompt_ids)
    logits = target.forward([cache], [torch.tensor(seq)], [1])[0]
    for _ in range(max_new):  # the target's own sampled continuation
        probs = process_logits(target.full_vocab_logits(logits, vocab_size)[-1], params)
        seq.append(coupled_choice(probs, params.seed, len(seq)))
        logits = target.forward([cache], [torch.tensor(seq[-1:])], [1])[0]
    n0 = len(prompt_ids)
    # Teacher forcing: the logits at the positions of the continuation, in one pass each.
    t_logits = target.full_vocab_logits(
        target.forward([target.new_cache()], [torch.tensor(seq[:-1])], [max_new])[0],
        vocab_size)
    d_logits = draft.forward([draft.new_cache()], [torch.tensor(seq[:-1])], [max_new])[0]
    q_params = _draft_params(params, q_top_k)
    vocab_map = None if draft.vocab_map is None else draft.vocab_map.cpu().numpy()
    rows = []
    for j in range(max_new):
        position = n0 + j
        p = process_logits(t_logits[j], params).double()
        q_out = process_logits(d_logits[j], q_params)
        q = torch.zeros(vocab_size, dtype=torch.float64)
        ids = torch.arange(q_out.shape[0]) if vocab_map is None else torch.from_numpy(vocab_map)
        q[ids] = q_out.double()
        tv = 0.5 * float((p - q).abs().sum())
        same = 0
        for m in range(noise_draws):  # independent noise: other seeds at this position
            seed = (params.seed + 1 + m) * 1_000_003
            t_tok = coupled_choice(p, seed, position)
            d_out = coupled_choice(q_out, seed, position, vocab_map)
            same += int((d_out if vocab_map is None else vocab_map[d_out]) == t_tok)
        rows.append((1.0 - tv, same / noise_draws, (1.0 - tv) / (1.0 + tv)))
    return {"rejection": [r[0] for r in rows], "coupled": [r[1] for r in rows],
            "coupled_floor": [r[2] for r in rows]}


def cmd_bench_rules(args) -> int:
    import numpy as np
    import torch
    from tqdm import tqdm

    from specdec.config import SamplingParams
    from specdec.models.loading import load_engine, resolve_draft_spec
    from specdec.models.tokenizer import encode_prompt

    cpu = torch.device("cpu")
    target, tokenizer, _ = load_engine(args.target, cpu)
    draft, _, _ = load_engine(resolve_draft_spec(args.draft, args.target), cpu)
    vocab_size = target.vocab_in
    prompts = _prompts(args)
    results = {}
    work = [(t, i) for t in args.temperatures for i in range(len(prompts))]
    per_t: dict[float, dict[str, list[float]]] = {
        t: {"rejection": [], "coupled": [], "coupled_floor": [], "tokens": []}
        for t in args.temperatures}
    paths: dict[float, list[dict]] = {t: [] for t in args.temperatures}
    for t, i in tqdm(work, desc="bench-rules", unit="prompt"):
        params = SamplingParams(temperature=t, seed=args.seed + i)
        ids = encode_prompt(tokenizer, prompts[i], None)
        acc = rule_acceptance(target, draft, vocab_size, ids, params, args.max_new_tokens,
                              args.noise_draws)
        paths[t].append(acc)
        for key in ("rejection", "coupled", "coupled_floor"):
            per_t[t][key] += acc[key]
    print(f"acceptance per draft token along the target's samples ({len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens; coupled: {args.noise_draws} noise draws per position)")
    ks = args.k
    header = ("| T | rejection 1-TV | coupled | coupled floor (1-TV)/(1+TV) | coupled/rejection | "
              + " | ".join(f"tok/round k={k} rej / coupled" for k in ks) + " |")
    print(header)
    print("|---" * (5 + len(ks)) + "|")
    for t in args.temperatures:
        d = per_t[t]
        rej, cou, flo = (float(np.mean(d[key])) for key in ("rejection", "coupled",
                                                             "coupled_floor"))
        tpr = {}
        for k in ks:
            tpr[k] = {rule: float(np.nanmean([tokens_per_round(np.array(p[rule]), k)
                                              for p in paths[t]]))
                      for rule in ("rejection", "coupled")}
        results[str(t)] = {"rejection": rej, "coupled": cou, "coupled_floor": flo,
                           "tokens_per_round": {str(k): v for k, v in tpr.items()}}
        print(f"| {t} | {rej:.3f} | {cou:.3f} | {flo:.3f} | {cou / rej:.2f} | "
              + " | ".join(f"{tpr[k]['rejection']:.2f} / {tpr[k]['coupled']:.2f}" for k in ks)
              + " |")
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "noise_draws": args.noise_draws, "results": results}
    if args.e2e:
        del target, draft
        report["e2e"] = end_to_end(args, [encode_prompt(tokenizer, p, None) for p in prompts])
    _write(args.out, "rules.json", report)
    return 0


E2E_SYSTEMS = (  # (label, bench system, rule); target-only with the coupled rule is the
    ("target-only", "specdec-target-only", "coupled"),  # reference text of the coupled rows
    ("spec coupled", "specdec-spec", "coupled"),
    ("spec rejection", "specdec-spec", "rejection"),
    ("pipelined coupled", "specdec-pipelined", "coupled"),
    ("pipelined rejection", "specdec-pipelined", "rejection"),
)


def end_to_end(args, prompt_ids: list[list[int]]) -> dict:
    """Every prompt at every temperature through each system of E2E_SYSTEMS, interleaved."""
    from tqdm import tqdm

    from bench.harness import SpecdecSystems
    from specdec.config import SamplingParams

    spd = SpecdecSystems(args.target, args.draft, args.threads,
                         [s for _, s, _ in E2E_SYSTEMS], decode_on=args.decode_on)
    rows: dict[str, dict[str, list]] = {}
    try:
        spd.connect()
        for _, system, rule in E2E_SYSTEMS:  # warm-up, not recorded
            spd.run(system, prompt_ids[0][:8], 8, None, SamplingParams(0.7, rule=rule))
        work = [(t, i) for t in args.temperatures for i in range(len(prompt_ids))]
        for t, i in tqdm(work, desc="bench-rules e2e", unit="prompt"):
            texts = {}
            for label, system, rule in E2E_SYSTEMS:
                params = SamplingParams(temperature=t, seed=args.seed + i, rule=rule)
                r = spd.run(system, prompt_ids[i], args.max_new_tokens, None, params)
                texts[label] = r.token_ids
                row = rows.setdefault(f"{t}|{label}", {"tokens": 0, "wall": 0.0, "drafted": 0,
                                                        "accepted": 0, "rounds": 0,
                                                        "same_as_target_only": 0, "runs": 0})
                row["tokens"] += len(r.token_ids)
                row["wall"] += r.wall_s
                row["drafted"] += r.draft_tokens
                row["accepted"] += r.accepted_tokens
                row["rounds"] += r.rounds
                row["runs"] += 1
                row["same_as_target_only"] += r.token_ids == texts["target-only"]
    finally:
        spd.close()
    print(f"end to end ({len(prompt_ids)} prompts x {args.max_new_tokens} new tokens, adaptive "
          f"k, one interleaved run)")
    print("| T | system | tok/s | vs target-only | acceptance | tokens/round | "
          "same tokens as target-only |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for t in args.temperatures:
        base = rows[f"{t}|target-only"]
        base_speed = base["tokens"] / base["wall"]
        for label, _, _ in E2E_SYSTEMS:
            row = rows[f"{t}|{label}"]
            speed = row["tokens"] / row["wall"]
            acc = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
            summary[f"{t}|{label}"] = dict(row, tokens_per_s=speed, acceptance=acc)
            print(f"| {t} | {label} | {speed:.1f} | {speed / base_speed:.2f}x | {acc:.3f} | "
                  f"{row['tokens'] / row['rounds']:.2f} | {row['same_as_target_only']}/"
                  f"{row['runs']} |")
    return summary


def register_divergence(sub) -> None:
    d = sub.add_parser("bench-divergence", help="how often speculative text differs from "
                       "target-only, and the smallest top-2 margins of the target's choices")
    d.add_argument("--prompts", nargs="+", default=["default", "grounded"],
                   help="prompt sets (default, grounded) or files (.jsonl / .txt)")
    d.add_argument("--limit", type=int, default=0, help="first N prompts of each set (0 = all)")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--temperature", type=float, default=0.8,
                   help="the sampled (coupled rule) runs' temperature")
    d.add_argument("--target", default="default")
    d.add_argument("--draft", default="default-draft")
    d.add_argument("--threads", type=int, default=0)
    d.add_argument("--out", default="bench/out")
    d.set_defaults(func=cmd_bench_divergence)


def choice_margins(engine, vocab_size: int, prompt_ids: list[int], token_ids: list[int],
                   params) -> list[float]:
    """At each generated position, how far the target's choice was from flipping (from one
    forward over the whole text): greedy, the gap between its two largest logits; coupled
    sampling, the gap between the two largest log p - log E of the race."""
    import numpy as np
    import torch

    from specdec.serving.sampling import coupling_noise, process_logits

    if not token_ids:
        return []
    seq = prompt_ids + token_ids
    logits = engine.full_vocab_logits(engine.forward(
        [engine.new_cache()], [torch.tensor(seq[:-1])], [len(token_ids)])[0], vocab_size)
    margins = []
    for j, row in enumerate(logits):
        if params.greedy:
            top = torch.topk(row, 2).values
            margins.append(float(top[0] - top[1]))
            continue
        p = process_logits(row, params).numpy().astype(np.float64)
        support = np.flatnonzero(p > 0)
        if support.size < 2:
            margins.append(float("inf"))
            continue
        race = np.log(p[support]) - np.log(coupling_noise(params.seed, len(prompt_ids) + j,
                                                          support))
        top2 = np.sort(race)[-2:]
        margins.append(float(top2[1] - top2[0]))
    return margins


def cmd_bench_divergence(args) -> int:
    import numpy as np
    import torch
    from tqdm import tqdm

    from bench.harness import SpecdecSystems
    from specdec.config import SamplingParams
    from specdec.models.loading import load_engine
    from specdec.models.tokenizer import encode_prompt

    # One thread: this process only scores margins between runs, and its OpenMP pool must not
    # spin on the cores the services are generating on.
    torch.set_num_threads(1)
    engine, tokenizer, _ = load_engine(args.target, torch.device("cpu"))
    prompts = _prompts(args)
    ids = [encode_prompt(tokenizer, p, None) for p in prompts]
    systems = ["specdec-target-only", "specdec-spec", "specdec-pipelined"]
    spd = SpecdecSystems(args.target, args.draft, args.threads, systems)
    kinds = {"greedy": lambda i: SamplingParams(),
             f"coupled T={args.temperature}": lambda i: SamplingParams(args.temperature, seed=i)}
    report: dict[str, dict] = {}
    try:
        spd.connect()
        for kind, make in kinds.items():
            rows = report.setdefault(kind, {"differ": {s: 0 for s in systems[1:]},
                                            "first_difference": [], "margins": [],
                                            "outputs": len(ids)})
            for i, prompt in enumerate(tqdm(ids, desc=f"divergence {kind}", unit="prompt")):
                params = make(i)
                ref = spd.run(systems[0], prompt, args.max_new_tokens, None, params).token_ids
                for s in systems[1:]:
                    out = spd.run(s, prompt, args.max_new_tokens, None, params).token_ids
                    if out != ref:
                        rows["differ"][s] += 1
                        rows["first_difference"].append(next(
                            (j for j, (a, b) in enumerate(zip(out, ref)) if a != b),
                            min(len(out), len(ref))))
                rows["margins"] += choice_margins(engine, engine.vocab_in, prompt, ref, params)
    finally:
        spd.close()
    print(f"{len(ids)} prompts x {args.max_new_tokens} new tokens; outputs compared with "
          "specdec target-only token by token; margins along the target-only outputs")
    print("| decoding | system | outputs that differ | positions | smallest margin | "
          "margins < 1e-3 | margins < 1e-4 |")
    print("|---|---|---|---|---|---|---|")
    for kind, rows in report.items():
        m = np.array(rows["margins"])
        rows["smallest_margins"] = sorted(m.tolist())[:5]
        rows["positions"] = int(m.size)
        for s, n in rows["differ"].items():
            print(f"| {kind} | {s} | {n}/{rows['outputs']} | {m.size} | {m.min():.2e} | "
                  f"{int((m < 1e-3).sum())} | {int((m < 1e-4).sum())} |")
        del rows["margins"]
    _write(args.out, "divergence.json", report)
    return 0
