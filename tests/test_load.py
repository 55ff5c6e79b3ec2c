"""A bounded load test of ``specdec serve`` on the real default pair, on loopback: 16 concurrent
streaming clients (the openai package) for 60 s, some of whose streams are abandoned and one of
which sends long prompts now and then. No request may fail, every greedy answer must
equal the target-only answer, the KV caches must stay under their cap and be freed at the end,
and the services' memory must not keep growing. Prints a report (``pytest -s``) and writes it
to ``load-report.txt`` in the test's tmp dir."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import statistics
import threading
import time

import openai
import pytest
from conftest import CHAT_PROMPTS, KEY, scrape

from bench.faults import services

pytestmark = pytest.mark.real

CLIENTS = 16
DURATION_S = 60.0  # how long new requests are started; the last ones then finish
MAX_TOKENS = 32
PROMPTS = CHAT_PROMPTS + [
    "Name two planets of the solar system.",
    "What does a gardener do in spring?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
]
MODES = ("pipelined", "spec")  # clients alternate; both must give the target-only text


@dataclasses.dataclass
class Outcome:
    prompt: str
    mode: str
    text: str
    completion_tokens: int
    finish_reason: str | None
    latency_s: float
    ttft_s: float


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _service_pids(serve_pid: int) -> dict[str, int]:
    """The target and draft service processes ``specdec serve`` started."""
    pids = services(serve_pid)
    assert set(pids) == {"target", "draft"}, pids
    return pids


class Sampler(threading.Thread):
    """Samples the services' RSS every 0.5 s and their KV cache gauges every 2 s."""

    def __init__(self, url: str, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.url, self.pids = url, pids
        self.rss: list[tuple[float, dict[str, int]]] = []  # (time, role -> KiB)
        self.cache: list[dict] = []  # scraped gauges
        self.stop = threading.Event()

    def gauges(self) -> dict:
        m = scrape(self.url, headers={"Authorization": f"Bearer {KEY}"})
        out = {}
        for role in ("target", "draft"):
            labels = (("service", role),)
            out[role] = dict(bytes=m[("specdec:service_cache_bytes", labels)],
                             cap=m[("specdec:service_cache_cap_bytes", labels)],
                             sessions=m[("specdec:service_sessions", labels)])
        return out

    def run(self) -> None:
        next_scrape = 0.0
        while not self.stop.wait(0.5):
            now = time.monotonic()
            self.rss.append((now, {r: _rss_kib(p) for r, p in self.pids.items()}))
            if now >= next_scrape:
                self.cache.append(self.gauges())
                next_scrape = now + 2.0


async def _one(client: openai.AsyncOpenAI, prompt: str, mode: str) -> Outcome:
    started = time.perf_counter()
    ttft = None
    text, finish, tokens = "", None, 0
    stream = await client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"specdec_mode": mode})
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - started
            text += delta
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Outcome(prompt, mode, text, tokens, finish, time.perf_counter() - started,
                   ttft if ttft is not None else float("nan"))


async def _abandoned(client: openai.AsyncOpenAI, prompt: str, mode: str) -> None:
    """A stream its client leaves after three chunks (its generation is cancelled)."""
    stream = await client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0.7, seed=1, stream=True, extra_body={"specdec_mode": mode})
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    await stream.close()


async def _long_prompt(client: openai.AsyncOpenAI) -> int:
    """A completion of a prompt of LONG_PROMPT token ids (its prefill runs in chunks beside
    the others' rounds): its completion tokens."""
    r = await client.completions.create(
        model="specdec", prompt=[100 + (i % 5000) for i in range(LONG_PROMPT)], max_tokens=1,
        temperature=0)
    return r.usage.completion_tokens


LONG_PROMPT = 1500  # ids, sent by one client now and then


async def _load(url: str, until: float) -> tuple[list[Outcome], list[str], dict[str, int]]:
    """CLIENTS clients until ``until``: mostly greedy streams (checked against target-only),
    every fifth request a stream abandoned after three chunks, and client 0's every fourth a
    long prompt (its first among them). Returns the checked outcomes, the failures, and counts
    of the others."""
    outcomes: list[Outcome] = []
    failures: list[str] = []
    others = {"abandoned": 0, "long": 0}

    async def client_loop(i: int) -> None:
        # max_retries=0: a failure must show, not be retried away
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=600) as client:
            n = i
            while time.monotonic() < until:
                prompt, mode = PROMPTS[n % len(PROMPTS)], MODES[(n // len(PROMPTS)) % 2]
                n += 1
                try:
                    if i == 0 and n % 4 == 1:  # from its first: one comes, however slow
                        assert await _long_prompt(client) == 1
                        others["long"] += 1
                    elif n % 5 == 0:
                        await _abandoned(client, prompt, mode)
                        others["abandoned"] += 1
                    else:
                        outcomes.append(await _one(client, prompt, mode))
                except Exception as exc:  # every kind of failure counts
                    failures.append(f"client {i}: {prompt!r} {mode}: {exc!r}")

    await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))
    return outcomes, failures, others


def _references(url: str) -> dict[str, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    refs = {}
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="specdec", messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS, temperature=0, extra_body={"specdec_mode": "target-only"})
        assert r.model_extra["specdec"]["draft_tokens"] == 0
        refs[prompt] = r.choices[0].message.content
    return refs


def _mib(kib: float) -> float:
    return kib / 1024.0


def test_16_streaming_clients_for_60s(serve_with_key, tmp_path):
    proc, url, _ = serve_with_key
    pids = _service_pids(proc.pid)
    references = _references(url)

    sampler = Sampler(url, pids)
    sampler.start()
    started = time.monotonic()
    outcomes, failures, others = asyncio.run(_load(url, started + DURATION_S))
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join(30)

    # the services let go of every session once the last request finished
    deadline = time.monotonic() + 60
    while any(g["sessions"] for g in sampler.gauges().values()):
        assert time.monotonic() < deadline, sampler.gauges()
        time.sleep(0.5)
    after = sampler.gauges()
    peak_rss = {r: _rss_kib(p, "VmHWM") for r, p in pids.items()}  # the kernel's high-water mark

    mismatches = [o for o in outcomes if o.text != references[o.prompt]]
    half = started + wall / 2
    first = {r: max(s[r] for t, s in sampler.rss if t < half) for r in pids}
    second = {r: max(s[r] for t, s in sampler.rss if t >= half) for r in pids}
    cache_peak = {r: max(g[r]["bytes"] for g in sampler.cache) for r in pids}
    caps = {r: sampler.cache[0][r]["cap"] for r in pids}
    latencies = sorted(o.latency_s for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    lines = [
        f"specdec load test: {CLIENTS} streaming clients, {DURATION_S:.0f} s of new requests, "
        f"{wall:.1f} s wall, max_tokens {MAX_TOKENS}, greedy, modes {'/'.join(MODES)}",
        f"requests: {len(outcomes) + len(failures) + sum(others.values())} ({len(outcomes)} "
        f"checked, {others['abandoned']} abandoned streams, {others['long']} of "
        f"{LONG_PROMPT} ids, {len(failures)} failed), differing from target-only: "
        f"{len(mismatches)}",
        f"tokens: {tokens} ({tokens / wall:.1f} tok/s aggregate); latency p50 "
        f"{statistics.median(latencies):.2f} s, p95 "
        f"{latencies[int(0.95 * (len(latencies) - 1))]:.2f} s; ttft p50 "
        f"{statistics.median(o.ttft_s for o in outcomes):.2f} s",
    ]
    for r in ("target", "draft"):
        lines.append(
            f"{r}: peak RSS {_mib(peak_rss[r]):.0f} MiB (max first half "
            f"{_mib(first[r]):.0f}, second half {_mib(second[r]):.0f}); KV cache peak "
            f"{cache_peak[r] / 2**20:.1f} MiB of a {caps[r] / 2**20:.0f} MiB cap; after: "
            f"{after[r]['sessions']:.0f} sessions, {after[r]['bytes']:.0f} bytes")
    lines += [f"FAILED {f}" for f in failures[:10]]
    lines += [f"DIFFERS {o.mode} {o.prompt!r}: {o.text!r}" for o in mismatches[:5]]
    report = "\n".join(lines)
    print("\n" + report)
    (tmp_path / "load-report.txt").write_text(report + "\n")

    assert not failures, report
    assert not mismatches, report
    assert len(outcomes) >= CLIENTS, report  # every client finished at least one request
    assert others["abandoned"] > 0 and others["long"] > 0, report
    assert all(o.finish_reason in ("stop", "length") for o in outcomes)
    assert all(0 < o.completion_tokens <= MAX_TOKENS for o in outcomes)
    for r in pids:
        assert cache_peak[r] <= caps[r], report
        assert after[r]["bytes"] == 0, report
        # memory is bounded: what the first half reached, the second does not outgrow
        # (generously: allocator caches settle, batches vary)
        assert second[r] - first[r] < max(256 * 1024, first[r] // 4), report
