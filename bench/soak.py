"""A soak of `specdec serve` on loopback, watched every 10 s: output tokens/s, requests, errors,
time to first token, the services' memory and KV sessions, and the machine's own state beside
it (CPU steal, other processes' CPU, load). Written to find what a throughput collapse is: the
server's (its sessions, caches, memory) or the machine's (steal, other load).

    python -m bench.soak --minutes 10            # the default pair, 4 clients
    python -m bench.soak --url http://127.0.0.1:8000 --minutes 30   # a server already running

Clients mix chat and completions, streamed and not, greedy and seeded, logprobs, n = 2, and
abandon one stream in ten after three chunks (as issue 38's soak did). Writes soak.json and,
with matplotlib, soak.png (tokens/s over time, with steal and other load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

import httpx

from bench.faults import services

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a haiku about autumn rain.",
    "What are three tips for learning a new language?",
    "Summarize the plot of a heist movie in two sentences.",
    "Give me a short Python function that reverses a string.",
    "Why do cats purr?",
]


def _cpu_ticks() -> tuple[int, int]:
    """(all CPU ticks, steal ticks) since boot (/proc/stat)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields[:8]), fields[7]


def _proc_ticks(pid: int) -> int:
    try:
        f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(f[11]) + int(f[12])  # utime + stime


def _rss_mib(pid: int) -> float:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Window:
    """What the clients saw in one interval."""

    def __init__(self):
        self.tokens = self.requests = self.errors = 0
        self.ttft: list[float] = []


async def client(i: int, url: str, until: float, windows: dict, interval: float,
                 started: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while time.monotonic() < until:
            prompt = rng.choice(PROMPTS)
            chat, stream = rng.random() < 0.7, rng.random() < 0.6
            body = {"model": "specdec", "max_tokens": rng.choice((16, 48, 96)),
                    "temperature": 0 if rng.random() < 0.5 else 0.8}
            if body["temperature"]:
                body["seed"] = rng.randrange(1000)
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            if rng.random() < 0.1:
                body["n"] = 2
            if rng.random() < 0.1:
                body["logprobs"] = True if chat else 2
            path = "/v1/chat/completions" if chat else "/v1/completions"
            t0 = time.monotonic()
            w = windows.setdefault(int((t0 - started) // interval), Window())
            try:
                if stream:
                    body["stream"] = True
                    body["stream_options"] = {"include_usage": True}
                    abandon = rng.random() < 0.1
                    chunks = 0
                    async with http.stream("POST", path, json=body) as r:
                        r.raise_for_status()
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            data = json.loads(line[6:])
                            if "error" in data:
                                raise RuntimeError(data["error"]["message"])
                            chunks += 1
                            if chunks == 1:
                                w.ttft.append(time.monotonic() - t0)
                            if data.get("usage"):
                                w.tokens += data["usage"]["completion_tokens"]
                            if abandon and chunks == 3:
                                break
                else:
                    r = await http.post(path, json=body)
                    r.raise_for_status()
                    w.tokens += r.json()["usage"]["completion_tokens"]
                    w.ttft.append(time.monotonic() - t0)
                w.requests += 1
            except Exception as exc:  # every failure counts
                w.errors += 1
                print(f"client {i}: {type(exc).__name__}: {exc}", file=sys.stderr)


async def watch(url: str, serve_pid: int | None, until: float, interval: float,
                started: float, machine: list) -> None:
    total0, steal0 = _cpu_ticks()
    ours0 = {}
    while time.monotonic() < until:
        await asyncio.sleep(interval)
        total, steal = _cpu_ticks()
        pids = services(serve_pid) if serve_pid else {}
        ours = {"serve": serve_pid, **pids} if serve_pid else {}
        ticks = {name: _proc_ticks(pid) for name, pid in ours.items() if pid}
        ours_used = sum(ticks[n] - ours0.get(n, ticks[n]) for n in ticks)
        sessions = {}
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("specdec:service_sessions{"):
                    sessions[line.split('service="')[1].split('"')[0]] = float(line.split()[-1])
        except httpx.HTTPError:
            pass
        d_total = max(total - total0, 1)
        machine.append({
            "t": round(time.monotonic() - started, 1),
            "steal": round((steal - steal0) / d_total, 4),
            "others_cpu": round(max(d_total - (ours_used if ours else 0), 0) / d_total, 3)
            if ours else None,
            "loadavg": os.getloadavg()[0],
            "rss_mib": {n: round(_rss_mib(p), 1) for n, p in ours.items() if p},
            "sessions": sessions})
        total0, steal0, ours0 = total, steal, ticks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a server already running (default: start `specdec serve`)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--out", default="bench/out/soak")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    url = args.url
    if url is None:
        port_file = os.path.join(tempfile.mkdtemp(prefix="bench-soak-"), "port")
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--port",
                                 "0", "--port-file", port_file],
                                stdout=open(out / "serve.log", "wb"), stderr=subprocess.STDOUT)
        while not os.path.exists(port_file):
            if proc.poll() is not None:
                raise SystemExit(f"specdec serve exited; see {out / 'serve.log'}")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{pathlib.Path(port_file).read_text()}"
    try:
        windows: dict[int, Window] = {}
        machine: list[dict] = []
        started = time.monotonic()
        until = started + 60 * args.minutes

        async def everything():
            await asyncio.gather(
                watch(url, proc.pid if proc else None, until, args.interval, started, machine),
                *(client(i, url, until, windows, args.interval, started)
                  for i in range(args.clients)))

        asyncio.run(everything())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    rows = []
    for i, m in enumerate(machine):
        w = windows.get(i, Window())
        ttft = sorted(w.ttft)
        rows.append({**m, "tokens_per_s": round(w.tokens / args.interval, 1),
                     "requests": w.requests, "errors": w.errors,
                     "ttft_p50_s": round(ttft[len(ttft) // 2], 3) if ttft else None})
    report = {"minutes": args.minutes, "clients": args.clients, "windows": rows,
              "errors": sum(r["errors"] for r in rows),
              "requests": sum(r["requests"] for r in rows)}
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"t={r['t']:6.0f}s tok/s {r['tokens_per_s']:6.1f} req {r['requests']:3d} "
              f"err {r['errors']} ttft50 {r['ttft_p50_s']} steal {r['steal']:.3f} "
              f"others {r['others_cpu']} load {r['loadavg']:.1f} rss {r['rss_mib']} "
              f"sessions {r['sessions']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        ts = [r["t"] for r in rows]
        ax.plot(ts, [r["tokens_per_s"] for r in rows], label="output tokens/s")
        ax.set_xlabel("seconds")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(ts, [r["steal"] for r in rows], "r--", label="CPU steal")
        ax2.plot(ts, [r["others_cpu"] or 0 for r in rows], "g:", label="other processes' CPU")
        ax2.set_ylabel("share of CPU")
        fig.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=100)
    except ImportError:
        pass
    print(f"{report['requests']} requests, {report['errors']} errors; {out / 'soak.json'}")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
