"""``specdec bench`` (system comparison) and ``specdec bench-verify`` (verify-pass cost)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time

from tqdm import tqdm

from orchestrator.generation import DECODE_ON
from specdec.config import DEFAULT_NUMERICS, NUMERICS

log = logging.getLogger(__name__)


def register(sub) -> None:
    b = sub.add_parser("bench", help="compare specdec with HF baselines on prompt sets")
    b.add_argument("--prompts", nargs="+", default=["default", "grounded"],
                   help="prompt sets (default, grounded) or files (.jsonl / .txt)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--limit", type=int, default=0, help="first N prompts of each set (0 = all)")
    b.add_argument("--systems", default=",".join(_systems("DEFAULT_SYSTEMS")),
                   help="comma-separated, of: " + ", ".join(_systems("ALL_SYSTEMS")) +
                   " (the -int8 ones draft with the target's own int8 copy, int8:<target>; "
                   "default: all others)")
    b.add_argument("--target", default="default")
    b.add_argument("--draft", default="default-draft")
    b.add_argument("--k", type=int, default=None, help="fixed k for specdec (default: adaptive)")
    b.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                   help="specdec drafts every block with the draft model (its acceptance "
                        "alone; by default a block the history repeats comes from prompt "
                        "lookup, as in `specdec generate`)")
    b.add_argument("--threads", type=int, default=0,
                   help="torch threads per specdec service (0 = torch's default, every core: "
                        "what `specdec generate` gives local services in its default mode)")
    b.add_argument("--hf-threads", type=int, default=0,
                   help="torch threads for HF baselines (0 = torch's default, every core)")
    b.add_argument("--bound", action="store_true",
                   help="measure the machine's read bandwidth (1 thread and the services') "
                        "and print the weight-streaming bound of a one-token step beside the "
                        "target's measured T(1) (a GGUF target)")
    b.add_argument("--decode-on", type=int, default=DECODE_ON, metavar="N",
                   help="plain target steps per call in rounds with no block, as `specdec "
                        "generate --decode-on` (default %(default)s; the "
                        "specdec-target-only-stepwise system always 0)")
    b.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="the specdec services' CPU numerics on a GGUF target (default "
                        "%(default)s: their greedy ids are checked against specdec "
                        "target-only's, and against HF's where the target computes float)")
    b.add_argument("--out", default="bench/out", help="directory for the JSON and PNG plots")
    b.add_argument("--json", action="store_true", help="also print the summary as JSON")
    b.add_argument("--concurrency", help="e.g. 1,2,4,8,16: throughput/latency vs concurrent "
                   "clients (specdec target-only, spec and pipelined; HF one at a time)")
    b.add_argument("--requests-per-client", type=int, default=3,
                   help="with --concurrency: requests each client sends, the next when its "
                        "answer arrives")
    b.add_argument("--repeats", type=int, default=1,
                   help="with --concurrency: sweeps of every level, the specdec systems in a "
                        "rotated order each time; rows give medians, ranges and the median "
                        "within-sweep ratio to target-only (HF is timed in the first sweep)")
    b.add_argument("--split", nargs="?", const="auto", metavar="TARGET:DRAFT",
                   help="separate hardware on one machine: the target service on some cores, "
                        "the draft on others, the HF baselines on the target's (e.g. 1:0, "
                        "2-3:0-1; bare --split: the upper half of the cores for the target)")
    b.add_argument("--rtt-ms", default="0", help="network round trips (ms) added between the "
                   "orchestrator and each service by a delaying proxy, e.g. 0,0.5,2: every "
                   "specdec system runs at each")
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("bench-verify", help="cost of a verify pass over m tokens vs one token")
    v.add_argument("--target", default="default")
    v.add_argument("--max-tokens", type=int, default=9)
    v.add_argument("--context", type=int, default=150)
    v.add_argument("--reps", type=int, default=15)
    v.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core, as "
                   "the services use)")
    v.add_argument("--engines", default="mkl,mkl-t,onednn,auto,integer",
                   help="engine-alone columns: CPU kernel choices in float numerics, "
                        "'integer' (smallm's integer numerics, where the target has codes), "
                        "and 'llamacpp' (llama.cpp on the same GGUF file and threads, logits "
                        "of every row; needs llama-cpp-python)")
    v.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="the in-service column's target numerics")
    v.add_argument("--no-service", action="store_true", help="the engines alone")
    v.add_argument("--out", default="bench/out")
    v.set_defaults(func=cmd_bench_verify)

    from bench import exactness, gpu

    gpu.register(sub)
    exactness.register(sub)
    exactness.register_divergence(sub)


def _systems(name: str) -> tuple[str, ...]:
    from bench import harness

    return getattr(harness, name)


def cmd_bench(args) -> int:
    from bench import report
    from bench import llamacpp
    from bench.harness import (
        BASELINE,
        EXTERNAL_SYSTEMS,
        LLAMACPP_SYSTEMS,
        Run,
        SpecdecSystems,
        load_prompts,
        system_name,
    )
    from specdec.models.hf_generate import HFGenerate
    from specdec.models.tokenizer import encode_prompt, eos_token_ids

    if args.concurrency:
        return cmd_concurrency(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(_systems("ALL_SYSTEMS"))
    if unknown:
        raise SystemExit(f"error: unknown systems {sorted(unknown)}")
    if BASELINE not in systems:
        systems.insert(0, BASELINE)  # every result is checked against it
    sets = {name: load_prompts(name) for name in args.prompts}
    if args.limit:
        sets = {k: v[: args.limit] for k, v in sets.items()}
    cores = split_cores(args.split, os.cpu_count() or 1) if args.split else None
    rtts = [float(x) for x in args.rtt_ms.split(",")]
    runs_of = [(s, None) if s in EXTERNAL_SYSTEMS else (s, r) for s in systems
               for r in (rtts if s not in EXTERNAL_SYSTEMS else [None])]
    separation = _separation(args.target, args.draft, systems, cores) if cores else None
    base_threads = args.hf_threads or (len(cores["target"]) if cores else 0)
    print(f"starting services and loading HF models for {', '.join(systems)} ...", flush=True)
    hf = HFGenerate(args.target, args.draft if "hf-assisted" in systems else None,
                    base_threads, cores=cores["target"] if cores else None)
    external = {s: hf for s in EXTERNAL_SYSTEMS if s not in LLAMACPP_SYSTEMS}
    if set(LLAMACPP_SYSTEMS) & set(systems):
        cpp = llamacpp.LlamaCpp(args.target, base_threads,
                                eos_token_ids(hf.tokenizer, hf.model.config),
                                cores["target"] if cores else None)
        external.update({s: cpp for s in LLAMACPP_SYSTEMS})
    spd = SpecdecSystems(args.target, args.draft, args.threads, systems, cores=cores, rtts=rtts,
                         decode_on=args.decode_on, numerics=args.numerics,
                         prompt_lookup=args.prompt_lookup)
    runs: list[Run] = []
    try:
        spd.connect()
        reference = spd.reference
        if reference not in systems:  # every specdec result is checked against it
            systems.insert(1, reference)
            runs_of.insert(1, (reference, rtts[0]))
        warm = encode_prompt(hf.tokenizer, "Hello!", None)
        for system, rtt in runs_of:  # warm-up, not recorded
            _run_one(system, external, spd, warm, 8, args.k, rtt)
        total = sum(len(p) for p in sets.values()) * len(runs_of)
        with tqdm(total=total, desc="bench", unit="run") as bar:
            for set_name, prompts in sets.items():
                for i, prompt in enumerate(prompts):
                    ids = encode_prompt(hf.tokenizer, prompt, None)
                    for system, rtt in runs_of:  # interleaved: drift hits every system alike
                        run = _run_one(system, external, spd, ids, args.max_new_tokens,
                                       args.k, rtt)
                        run.prompt_set, run.prompt_index = set_name, i
                        runs.append(run)
                        bar.update(1)
        target_ms = spd.target_forward_ms
    finally:
        spd.close()
    names = [system_name(s, r) for s, r in runs_of]
    summary = report.summarize(runs, names, list(sets), target_ms, reference)
    if args.bound:
        summary["streaming_bound"] = llamacpp.streaming_bound(
            args.target, sorted({1, base_threads or os.cpu_count() or 1}))
    summary["split"] = cores
    summary["separation"] = separation
    return _report(args, runs, summary, target_ms, separation)


def _report(args, runs, summary: dict, target_ms, separation) -> int:
    """Write bench.json and the plots, print the table (and the bound, the cores'
    separation, the JSON); 1 where a run's token ids differ from HF target-only's."""
    from bench import report

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "specdec bench " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k in ("prompts", "max_new_tokens", "limit", "systems", "draft", "k", "threads",
                 "hf_threads", "split", "rtt_ms", "decode_on") and v and v != "0")
    summary["command"] = command
    summary["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "bench.json").write_text(json.dumps(
        {"summary": summary, "runs": [r.__dict__ for r in runs]}, indent=1))
    print(report.table(summary))
    if summary.get("streaming_bound"):
        print(report.bound_line(summary["streaming_bound"], target_ms))
    if separation is not None:
        print(_separation_line(separation))
    for path in report.plots(runs, summary, out):
        print(f"wrote {path}")
    if args.json:
        print(json.dumps(summary, indent=2))
    mismatches, reference = summary["mismatches"], REFERENCE_NAMES[summary["reference"]]
    if mismatches:
        print(f"MISMATCH: {len(mismatches)} runs differ from {reference}: {mismatches[:5]}")
        return 1
    print(f"all specdec systems' greedy token ids equal {reference}'s")
    return 0


def cmd_concurrency(args) -> int:
    from bench import concurrency
    from bench.harness import SpecdecSystems, load_prompts
    from specdec.models.hf_generate import HFGenerate
    from specdec.models.tokenizer import encode_prompt

    levels = [int(x) for x in args.concurrency.split(",")]
    if any(n < 1 for n in levels):
        raise SystemExit("error: concurrency levels must be >= 1")
    if args.requests_per_client < 1:
        raise SystemExit("error: --requests-per-client must be >= 1")
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")
    prompts = [p for name in args.prompts for p in load_prompts(name)]
    if args.limit:
        prompts = prompts[: args.limit]
    cores = split_cores(args.split, os.cpu_count() or 1) if args.split else None
    hf = HFGenerate(args.target, None, args.hf_threads or (len(cores["target"]) if cores else 0),
                    cores=cores["target"] if cores else None)
    spd = SpecdecSystems(args.target, args.draft, args.threads,
                         list(concurrency.SYSTEMS[1:]), cores=cores, decode_on=args.decode_on,
                         numerics=args.numerics)
    try:
        spd.connect()
        ids = [encode_prompt(hf.tokenizer, p, None) for p in prompts]
        summary = concurrency.run_levels(levels, ids, args.max_new_tokens, hf, spd, args.k,
                                         args.requests_per_client, args.repeats)
    finally:
        spd.close()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary["command"] = f"specdec bench --concurrency {args.concurrency} " \
                         f"--max-new-tokens {args.max_new_tokens} " \
                         f"--requests-per-client {args.requests_per_client} " \
                         f"--repeats {args.repeats}" + \
                         (f" --split {args.split}" if args.split else "")
    summary["split"] = cores
    (out / "concurrency.json").write_text(json.dumps(summary, indent=1))
    print(concurrency.table(summary))
    print(f"wrote {concurrency.plot(summary, out)}")
    bad, reference = sum(r["mismatches"] for r in summary["rows"]), \
        REFERENCE_NAMES[summary["reference"]]
    if bad:
        print(f"MISMATCH: {bad} answers differ from {reference}")
        return 1
    print(f"every specdec answer's greedy token ids equal {reference}'s")
    return 0


def _run_one(system, external, spd, ids, max_new, k, rtt=None):
    """One generation of a system: ``external`` maps the systems specdec does not run (HF,
    llama.cpp) to their runners."""
    from bench.harness import Run

    if system in external:
        tokens, wall = external[system].run(system, ids, max_new)
        return Run(system=system, prompt_set="", prompt_index=-1, token_ids=tokens, wall_s=wall)
    return spd.run(system, ids, max_new, k, rtt=rtt)


def _separation(target: str, draft: str, systems: list[str], cores: dict) -> dict | None:
    """``--split``: how separate the cores are before the runs (bench.contention), with the
    int8 copy where an -int8 system runs, else the draft (none for the n-gram drafter)."""
    from bench import contention
    from bench.harness import INT8_SYSTEMS
    from specdec.config import INT8

    spec = f"{INT8}:{target}" if set(INT8_SYSTEMS) & set(systems) else draft
    if spec == "ngram":
        return None
    print(f"timing {target} and {spec} alone and side by side on the split cores ...", flush=True)
    m = contention.measure(target, spec, cores, [1, 5], 9)
    return dict(m, draft=spec)


def _separation_line(m: dict) -> str:
    t = ", ".join(f"{n} tokens {a:.1f} -> {m['target_with_draft'][n]:.1f} ms "
                  f"({m['target_with_draft'][n] / a:.2f}x)" for n, a in m["target_alone"].items())
    d = m["draft_with_target"] / m["draft_alone"]
    return (f"split cores' separation before the runs (python -m bench.contention): the "
            f"target's forward alone -> beside {m['draft']}'s steps: {t}; its step "
            f"{m['draft_alone']:.1f} -> {m['draft_with_target']:.1f} ms ({d:.2f}x) beside "
            f"the target's passes")


def split_cores(spec: str, n_cores: int) -> dict[str, list[int]]:
    """``--split``: "auto" (the target on the upper half of the cores, the draft on the rest)
    or "TARGET:DRAFT" core lists (taskset syntax: 1 / 0-3 / 0,2)."""
    if spec == "auto":
        if n_cores < 2:
            raise SystemExit("error: --split needs at least 2 cores")
        half = n_cores // 2
        return {"target": list(range(half, n_cores)), "draft": list(range(half))}

    def cores(part: str) -> list[int]:
        out = []
        for item in part.split(","):
            lo, _, hi = item.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
        return out

    try:
        target, draft = (cores(p) for p in spec.split(":"))
    except ValueError:
        raise SystemExit(f"error: --split wants TARGET:DRAFT core lists, e.g. 1:0, got {spec!r}")
    if set(target) & set(draft) or not target or not draft:
        raise SystemExit(f"error: --split needs two disjoint, non-empty core sets, got {spec!r}")
    if max(target + draft) >= n_cores:
        raise SystemExit(f"error: --split {spec}: this machine has cores 0-{n_cores - 1}")
    return {"target": target, "draft": draft}


# the bench's exactness reference, by its system name
REFERENCE_NAMES = {"hf": "HF target-only", "specdec-target-only": "specdec target-only"}


def cmd_bench_verify(args) -> int:
    """Median forward cost over m new tokens (m = 1..N): the engine alone with each CPU kernel
    choice, and a verify call inside a running target service (its reported compute)."""
    import torch

    from bench import report
    from specdec.models.loading import load_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    ctx, ms = args.context, range(1, args.max_tokens + 1)
    ids = (torch.arange(ctx + args.max_tokens) % 1000 + 10).tolist()  # a context, then rows
    timers = {}  # name -> ms(rows), in the order given
    for name in args.engines.split(","):
        if name == "llamacpp":  # llama.cpp on the same GGUF file and threads
            from bench.llamacpp import INSTALL, forward_timer

            timers[name] = forward_timer(args.target, args.threads, ids, ctx)
            if timers[name] is None:
                raise SystemExit(f"error: the llamacpp column needs llama-cpp-python: {INSTALL}")
            continue
        if name == "integer":
            engine, _, _ = load_engine(args.target, torch.device("cpu"), "auto", "integer")
            if engine.numerics != "integer":
                print(f"(no integer column: {args.target} has no codes for it)")
                continue
        else:
            engine, _, _ = load_engine(args.target, torch.device("cpu"), name, "float")
        timers[name] = engine.forward_timer(ctx, args.max_tokens)
    engine = None  # the timers hold the engines, freed with them below
    times = {n: {m: [] for m in ms} for n in [*timers] + ([] if args.no_service
                                                           else ["in-service"])}
    for _ in tqdm(range(args.reps), desc="engine cost", unit="rep"):
        for m in ms:
            for n, timer in timers.items():  # interleaved
                times[n][m].append(timer(m))
    del timers  # (and the engines they hold)
    if not args.no_service:
        for m, values in _in_service_verify_ms(args.target, args.threads, ids[:ctx], ms,
                                               args.reps, args.numerics).items():
            times["in-service"][m] = values
    med = {n: {m: sorted(v)[len(v) // 2] for m, v in d.items()} for n, d in times.items()}
    names = list(med)
    print(f"median ms per forward (context {ctx}, {args.threads or torch.get_num_threads()} "
          f"thread(s), {args.reps} reps; in-service = a target service's compute_ms for a "
          f"verify of m - 1 draft tokens)")
    print("| m | " + " | ".join(names) + " | " + " | ".join(f"{n} T(m)/T(1)" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for m in ms:
        print(f"| {m} | " + " | ".join(f"{med[n][m]:.1f}" for n in names) + " | "
              + " | ".join(f"{med[n][m] / med[n][1]:.2f}" for n in names) + " |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps({"median_ms": med, "context": ctx,
                                                      "threads": args.threads}, indent=1))
    path = report.plot_verify_cost(med, out)
    print(f"wrote {path}")
    alone = "integer" if args.numerics == "integer" and "integer" in med else "auto"
    if "in-service" in med and alone in med:
        ratio = med["in-service"][1] / med[alone][1]
        print(f"in-service / engine-alone T(1) = {ratio:.2f}"
              + ("" if ratio < 1.15 else "  <- the service's model thread runs slower than the "
                 "engine alone: see specdec.rpc.host.in_passing_thread"))
    if len(ms) >= 5:
        print("T(5)/T(1): " + ", ".join(f"{n} {med[n][5] / med[n][1]:.2f}" for n in names))
    # what one more verify row costs, as a share of a 1-token forward (the issue-34 goal: 0.10)
    print("extra row / T(1), (T(m) - T(1)) / ((m - 1) T(1)) at m = " +
          ", ".join(str(m) for m in ms if m > 1) + ": " + "; ".join(
              f"{n} " + " ".join(f"{(med[n][m] - med[n][1]) / ((m - 1) * med[n][1]):.2f}"
                                 for m in ms if m > 1) for n in names))
    return 0


def _in_service_verify_ms(target: str, threads: int, prompt: list[int], ms, reps: int,
                          numerics: str = DEFAULT_NUMERICS) -> dict:
    """compute_ms of verify calls over m tokens (m - 1 drafts) in a local target service."""
    import asyncio

    from orchestrator.local import ServiceProcess, service_args
    from orchestrator.service_clients import History, TargetClient
    from specdec.config import SamplingParams

    async def measure(address: str) -> dict:
        client = TargetClient(address)
        await client.wait_ready()
        history, greedy = History(prompt), SamplingParams()
        out = {m: [] for m in ms}
        try:
            for rep in tqdm(range(reps + 1), desc="in-service cost", unit="rep"):
                for m in ms:
                    resp, _ = await client.verify("bench-verify", history, [100] * (m - 1), [],
                                                  greedy)
                    if rep:  # rep 0 warms up
                        out[m].append(resp.compute_ms)
        finally:
            await client.close_session("bench-verify")
            await client.close()
        return out

    service = ServiceProcess("target", service_args(target, threads, ["--no-calibrate",
                                                                      "--numerics", numerics]))
    try:
        service.wait_port()
        return asyncio.run(measure(service.address))
    finally:
        service.stop()
