"""Does a long prompt stall a small request? Its tokens/s alone, and beside a long prompt.

Starts the target service (target-only generation: every token is one verify pass on it),
times a small greedy request alone, then sends a long prompt (token ids
``[100 + (i % 5000) for i in range(n)]``, one new token) and, once that prompt is prefilling,
small requests back to back until it is answered. Per prompt length it prints the small
requests' tokens/s beside the prompt over their tokens/s alone (the scheduler aims to keep
it >= 0.5), and the long prompt's completion time, shared and alone:

    python -m bench.long_prompt [--lengths 2000 4000 8000] [--small-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from tqdm import tqdm


def long_prompt_ids(n: int) -> list[int]:
    return [100 + (i % 5000) for i in range(n)]


SMALL_PROMPT = [1, 520, 3300, 12, 99, 7]


async def _timed(orch, prompt: list[int], max_new: int) -> tuple[int, float]:
    """(tokens generated, seconds) of one greedy target-only request."""
    from orchestrator.generation import GenerationRequest

    started = time.perf_counter()
    result = await orch.generate(GenerationRequest(prompt, max_new, mode="target-only", k=0))
    return len(result.token_ids), time.perf_counter() - started


async def _small_alone(orch, max_new: int, repeats: int, bar) -> float:
    """Median tokens/s of the small request with nothing else running."""
    rates = []
    for _ in range(repeats):
        tokens, seconds = await _timed(orch, SMALL_PROMPT, max_new)
        rates.append(tokens / seconds)
        bar.update(1)
    return statistics.median(rates)


async def _beside(orch, n: int, max_new: int, lead_s: float) -> dict:
    """A long prompt of ``n`` ids, and small requests back to back from ``lead_s`` after it
    was sent until it is answered (the last one may end after it: it is counted only if no
    other ended before)."""
    long_task = asyncio.create_task(_timed(orch, long_prompt_ids(n), 1))
    sent = time.perf_counter()
    await asyncio.sleep(lead_s)
    small = []
    while not long_task.done():
        tokens, seconds = await _timed(orch, SMALL_PROMPT, max_new)
        if long_task.done() and small:
            break  # this one ran partly alone
        small.append(tokens / seconds)
    await long_task
    long_s = long_task.result()[1]
    return dict(small_tokens_per_s=statistics.median(small) if small else None,
                small_requests=len(small), long_s=long_s,
                long_answered_after_s=time.perf_counter() - sent)


async def _measure(orch, lengths: list[int], max_new: int, repeats: int, lead_s: float,
                   long_alone: bool) -> dict:
    steps = repeats * (1 + len(lengths)) + len(lengths) * (1 + long_alone)
    rows = []
    with tqdm(total=steps, desc="long prompts", unit="run") as bar:
        alone = await _small_alone(orch, max_new, repeats, bar)
        for n in lengths:
            row = dict(prompt_tokens=n)
            if long_alone:
                row["long_alone_s"] = (await _timed(orch, long_prompt_ids(n), 1))[1]
                bar.update(1)
            shared = await _beside(orch, n, max_new, lead_s)
            bar.update(1)
            row.update(shared)
            rate = shared["small_tokens_per_s"]
            row["small_ratio"] = rate / alone if rate else None
            # the small request again alone, so that drift over the run shows
            row["small_alone_after"] = await _small_alone(orch, max_new, repeats, bar)
            rows.append(row)
    return dict(small_alone_tokens_per_s=alone, small_tokens=max_new, rows=rows)


def _print(report: dict) -> None:
    print(f"small request ({report['small_tokens']} tokens) alone: "
          f"{report['small_alone_tokens_per_s']:.1f} tokens/s")
    print(f"{'prompt':>7} {'small tok/s':>11} {'ratio':>6} {'n':>3} {'long s':>7} "
          f"{'alone s':>7} {'small alone after':>17}")
    for r in report["rows"]:
        rate, ratio = r["small_tokens_per_s"], r["small_ratio"]
        print(f"{r['prompt_tokens']:>7} {rate or 0:>11.1f} {ratio or 0:>6.2f} "
              f"{r['small_requests']:>3} {r['long_s']:>7.2f} {r.get('long_alone_s', 0):>7.2f} "
              f"{r['small_alone_after']:>17.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.long_prompt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 8000],
                   help="long prompt lengths, in token ids (capped to fit the context)")
    p.add_argument("--small-tokens", type=int, default=64, help="tokens the small request asks")
    p.add_argument("--repeats", type=int, default=3, help="small requests alone, per median")
    p.add_argument("--lead-s", type=float, default=0.3,
                   help="seconds between sending the long prompt and the first small request")
    p.add_argument("--no-long-alone", dest="long_alone", action="store_false",
                   help="skip timing each long prompt alone")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="the target service's torch threads")
    p.add_argument("--target-arg", action="append", default=[],
                   help="an extra flag for the target service, e.g. --target-arg=--prefill-chunk=128")
    p.add_argument("--out", help="write the report here as JSON")
    args = p.parse_args(argv)

    from orchestrator.local import ServiceProcess, service_args
    from orchestrator.pair import close, connect

    service = ServiceProcess("target", service_args(args.target, args.threads, args.target_arg))
    loop = asyncio.new_event_loop()
    try:
        service.wait_port()
        # a long prompt beside busy small requests prefills slowly: allow it minutes
        orch = loop.run_until_complete(connect(service.address, None, tokenizer_spec=args.target,
                                               timeout_s=600.0))
        try:
            context = int(orch.target.info.max_context)
            lengths = [min(n, context - 1) for n in args.lengths]
            report = loop.run_until_complete(_measure(
                orch, lengths, args.small_tokens, args.repeats, args.lead_s, args.long_alone))
        finally:
            loop.run_until_complete(close(orch))
    finally:
        loop.close()
        service.stop()
    report.update(target=args.target, threads=args.threads, target_args=args.target_arg)
    _print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
