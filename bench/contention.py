"""How separate are separate cores? Each model's forward alone on its cores, and while the other
model runs back to back on its own, and what that leaves pipelining.

``specdec bench --split`` gives draft and target disjoint cores of one machine, but the cores
still share the memory system (DRAM bandwidth, the last-level cache). A model's forward at a few
rows streams its weights and is bound by that bandwidth, so on one machine a draft step and a
verify pass that overlap slow each other down, where on two machines they would not. This
measures it, and bounds what overlapping can gain over sequential rounds here:

    python -m bench.contention [--target default] [--draft int8:default] [--split 1:0]

Sequential rounds (spec) run k draft steps, then a verify pass over k + 1 tokens, each alone:
``S = k * d + T(k + 1)``. A pipelined round runs them at once: while both run, each advances at
its alone-time over its contended time; the one left finishes alone (``pipelined_round_ms``).
``S / P`` is the most a pipelined round can gain over a sequential one with the same block on
this machine, whatever the scheduling (before round trips, which pipelining also hides).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics

from tqdm import tqdm


def pipelined_round_ms(draft_ms: float, verify_ms: float, draft_rate: float,
                       verify_rate: float) -> float:
    """Wall time of a draft call of ``draft_ms`` and a verify of ``verify_ms`` (each alone)
    started together, each running at ``rate`` (alone time / contended time, <= 1) while the
    other runs and at full speed once it is done."""
    t_draft, t_verify = draft_ms / draft_rate, verify_ms / verify_rate
    if t_draft <= t_verify:  # the draft ends first: the verify's rest runs alone
        return t_draft + verify_ms - t_draft * verify_rate
    return t_verify + draft_ms - t_verify * draft_rate


def _worker(spec: str, cores: list[int], conn, loop_rows: int, stop) -> None:
    """A model on its cores: answers ("time", rows, reps) with forward times (ms) and ("loop",)
    by running forwards of ``loop_rows`` back to back until ``stop`` is set."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    from specdec.models.loading import load_draft_engine

    engine = load_draft_engine(spec, torch.device("cpu"))[0]  # a feature draft too
    timer = engine.forward_timer()
    timer(1)  # warm
    conn.send(("ready", sorted(os.sched_getaffinity(0))))
    while True:
        msg = conn.recv()
        if msg[0] == "time":
            conn.send([timer(msg[1]) for _ in range(msg[2])])
        elif msg[0] == "loop":
            conn.send("looping")
            while not stop.is_set():
                timer(loop_rows)
            conn.send("stopped")
        else:
            return


class _Side:
    def __init__(self, ctx, spec: str, cores: list[int], loop_rows: int):
        self.conn, child = ctx.Pipe()
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=_worker, args=(spec, cores, child, loop_rows, self.stop),
                                daemon=True)
        self.proc.start()

    def ready(self) -> list[int]:
        """The cores the worker runs on, once its model is loaded."""
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise RuntimeError("worker failed to start")
        return msg[1]

    def time(self, rows: int, reps: int) -> float:
        self.conn.send(("time", rows, reps))
        return statistics.median(self.conn.recv())

    def start_loop(self) -> None:
        self.stop.clear()
        self.conn.send(("loop",))
        assert self.conn.recv() == "looping"

    def stop_loop(self) -> None:
        self.stop.set()
        assert self.conn.recv() == "stopped"

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.terminate()


def measure(target: str, draft: str, cores: dict[str, list[int]], rows: list[int],
            reps: int) -> dict:
    """Median ms of the target's forward over each of ``rows`` tokens and of the draft's
    one-token step, each alone and while the other runs back to back (the target at the
    median of ``rows``, as a verify pass of a typical block)."""
    from specdec.models.loading import resolve_draft_spec

    ctx = multiprocessing.get_context("spawn")
    verify_rows = sorted(rows)[len(rows) // 2]
    t = _Side(ctx, target, cores["target"], verify_rows)
    d = _Side(ctx, resolve_draft_spec(draft, target), cores["draft"], 1)
    out = {"target_alone": {}, "target_with_draft": {}, "verify_rows": verify_rows}
    try:
        out["cores"] = {"target": t.ready(), "draft": d.ready()}
        with tqdm(total=2 * len(rows) + 2, desc="contention", unit="probe") as bar:
            for m in rows:
                out["target_alone"][m] = t.time(m, reps)
                bar.update(1)
            out["draft_alone"] = d.time(1, reps)
            bar.update(1)
            d.start_loop()
            for m in rows:
                out["target_with_draft"][m] = t.time(m, reps)
                bar.update(1)
            d.stop_loop()
            t.start_loop()
            out["draft_with_target"] = d.time(1, reps)
            t.stop_loop()
            bar.update(1)
    finally:
        t.close()
        d.close()
    return out


def bounds(m: dict) -> list[dict]:
    """Per block length k (k + 1 in the measured rows): the sequential round, the pipelined
    round under the measured contention, and their ratio (also without contention)."""
    d_alone = m["draft_alone"]
    d_rate = d_alone / m["draft_with_target"]
    rows = []
    for tokens, t_alone in sorted(m["target_alone"].items()):
        k = tokens - 1
        if k < 1:
            continue
        t_rate = t_alone / m["target_with_draft"][tokens]
        seq = k * d_alone + t_alone
        pipe = pipelined_round_ms(k * d_alone, t_alone, d_rate, t_rate)
        rows.append(dict(k=k, sequential_ms=seq, pipelined_ms=pipe, bound=seq / pipe,
                         bound_separate=seq / max(k * d_alone, t_alone)))
    return rows


def main(argv=None) -> dict:
    from bench.cli import split_cores

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="int8:default")
    p.add_argument("--split", default="auto", help="TARGET:DRAFT cores (as specdec bench "
                   "--split; auto: the upper half of the cores for the target)")
    p.add_argument("--rows", default="1,2,3,5,9", help="target forward sizes (tokens)")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    cores = split_cores(args.split, os.cpu_count() or 1)
    rows = [int(r) for r in args.rows.split(",")]
    m = measure(args.target, args.draft, cores, rows, args.reps)
    print(f"target {args.target} on cores {cores['target']}, draft {args.draft} on cores "
          f"{cores['draft']}; median ms of {args.reps}")
    print("| forward | alone | while the other runs | slowdown |")
    print("|---|---|---|---|")
    for tokens, alone in sorted(m["target_alone"].items()):
        w = m["target_with_draft"][tokens]
        print(f"| target, {tokens} tokens | {alone:.1f} | {w:.1f} | {w / alone:.2f}x |")
    print(f"| draft, 1 token (target at {m['verify_rows']}) | {m['draft_alone']:.1f} | "
          f"{m['draft_with_target']:.1f} | {m['draft_with_target'] / m['draft_alone']:.2f}x |")
    print("\n| k | sequential round ms | pipelined round ms | most pipelined / sequential here |"
          " the same on separate machines |")
    print("|---|---|---|---|---|")
    rows_out = bounds(m)
    for r in rows_out:
        print(f"| {r['k']} | {r['sequential_ms']:.1f} | {r['pipelined_ms']:.1f} | "
              f"{r['bound']:.2f}x | {r['bound_separate']:.2f}x |")
    m["bounds"] = rows_out
    return m


if __name__ == "__main__":
    main()
