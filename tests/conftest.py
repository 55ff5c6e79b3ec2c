"""Shared fixtures: tiny random-weight models, real gRPC services on loopback, the real pair.

A test's verdict never rests on how fast the machine is (CI runs on 2 shared cores): choices
made from costs are asserted over crafted costs (loop_fakes' records give the cost model
their nominal times), a race the test needs is forced (a gate, an event, an injected clock),
a wait ends when its condition holds (``wait_for``) with a bound far past a busy machine's,
and speed itself is measured in bench/, never asserted here."""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray on loopback: without this Ray swaps 127.0.0.1 in an address for the machine's IP, where
# a cluster started with node IP 127.0.0.1 does not listen.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a busy 2-core machine Serve's HTTP proxy can take longer than its default 5 s readiness
# check to come up; the controller then kills and restarts it forever.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")

REPO = pathlib.Path(__file__).resolve().parents[1]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU does in two sentences.",
    "List three fruits and their colors.",
]


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) (Linux: 32768 by default)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a server that a test starts later, taken below the kernel's
    ephemeral range. A port from bind(0) is free only until some process binds port 0 and is
    handed the same one: Ray starts many processes that do, and in CI Ray Serve's proxy found
    the port a test had chosen for it taken ("Address already in use") by then."""
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(max(1024, low - 16000), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port found below {low}")


def run(coro):
    """Run a coroutine to completion in a fresh event loop (tests are synchronous)."""
    return asyncio.run(coro)


def make_tiny_model(path: pathlib.Path, seed: int, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, vocab: int | None = None,
                    noise: float = 0.0) -> pathlib.Path:
    """A random-weight Llama with the default target's tokenizer, saved as an HF directory.

    ``noise`` > 0 perturbs every weight (relative scale): a draft that agrees with the
    same-seed model often but not always.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.hub import load_tokenizer

    tokenizer = load_tokenizer("default")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        model.lm_head.weight.mul_(20.0)
        if noise:
            perturb(model, seed, noise)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Two different tiny models sharing the default tokenizer: a target and a (bad) draft."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": str(make_tiny_model(root / "target", seed=1, layers=2)),
        "draft": str(make_tiny_model(root / "draft", seed=2, layers=1)),
        # the target with noise: agrees often but not always (exercises both branches)
        "near_draft": str(make_tiny_model(root / "near", seed=1, layers=2, noise=0.15)),
    }


def perturb(model, seed: int, noise: float) -> None:
    """Add Gaussian noise of relative scale ``noise`` to every weight, in place: a draft that
    agrees with the unperturbed model often but not always."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())


def wait_for_port_file(proc, port_file: pathlib.Path, log_path: pathlib.Path,
                       timeout: float, what: str = "specdec serve") -> int:
    """The port a started server writes to ``port_file``; fails with its log's tail if the
    process exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.2)
    return int(port_file.read_text())


class ServiceThread:
    """A real gRPC service (draft or target) on 127.0.0.1, in its own thread and event loop."""

    def __init__(self, role: str, model: str, target: str = "default", q_top_k: int = 64,
                 **config):
        from specdec.config import ServiceConfig

        config.setdefault("calibrate", False)
        config.setdefault("batch_wait_ms", 0.0)
        self.config = ServiceConfig(model=model, role=role, **config)
        self.role = role
        self.target = target
        self.q_top_k = q_top_k
        self.loop = asyncio.new_event_loop()
        self.host = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        self._ready.wait(300)
        if self._error:
            raise self._error

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        if self._error is None:
            self.loop.run_forever()

    async def _start(self) -> None:
        try:
            if self.role == "target":
                from target_service.server import make_host

                self.host = make_host(self.config)
            else:
                from draft_service.server import make_host

                self.host = make_host(self.config, target=self.target, q_top_k=self.q_top_k)
            await self.host.start()
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.host.port}"

    @property
    def runtime(self):
        return self.host.runtime

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.host.stop(0), self.loop)
        fut.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def with_draft_service(services: dict, key: str, draft_dir: str, target: str):
    """A module fixture's body: ``services`` and, under ``key``, a draft service of
    ``draft_dir`` beside ``target``, stopped after the module."""
    services = dict(services)
    services[key] = ServiceThread("draft", draft_dir, target=target)
    yield services
    services[key].stop()


@pytest.fixture(scope="session")
def tiny_services(tiny_models):
    """Target = tiny target; drafts: the tiny (disagreeing) draft, the target itself, n-gram."""
    target = tiny_models["target"]
    services = {
        "target": ServiceThread("target", target),
        "draft": ServiceThread("draft", tiny_models["draft"], target=target),
        "self_draft": ServiceThread("draft", target, target=target),
        "ngram": ServiceThread("draft", "ngram", target=target),
        "near_draft": ServiceThread("draft", tiny_models["near_draft"], target=target),
    }
    yield services
    for s in services.values():
        s.stop()


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy ids from transformers' own generate (the reference)."""
    from specdec.models.hub import load_hf_model

    model, _ = _hf_cache.get(model_dir) or _hf_cache.setdefault(model_dir, load_hf_model(model_dir))
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


_hf_cache: dict = {}


# ---- shared by several test modules (not imported from each other) ----------------------

def _smallm_here() -> bool:
    from specdec.serving.kernels import smallm_available

    return smallm_available(torch.device("cpu"))


# Tests of specdec's native kernels skip where they cannot be built or run here.
HAS_SMALLM = _smallm_here()
needs_smallm = pytest.mark.skipif(not HAS_SMALLM, reason="no C compiler or no AVX2 / AVX-512")


MODEL = "tiny"  # the model name the test API servers serve
# Token-id prompts for the tiny models: short, longer, and repetitive (n-gram drafts match)
TOKEN_PROMPTS = [[1, 520, 3300, 12, 99, 7], list(range(2000, 2040)), [5, 6, 7, 5, 6, 7, 5, 6]]


class ApiHost:
    """An event loop in a thread holding an Orchestrator over real services, and real uvicorn
    servers (port 0) of apps over it: gRPC channels belong to the loop that made them."""

    def __init__(self, target_addr: str, draft_addr: str | None):
        from orchestrator.pair import connect

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.orch = self.call(connect(target_addr, draft_addr, tokenizer_spec="default",
                                      target_deadline_s=2.0))
        self.servers = []

    def call(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app=None, **kw) -> str:
        """Serve ``app`` (default: a fresh create_app over the orchestrator); its base URL."""
        import uvicorn

        from orchestrator.http.app import create_app

        async def start():
            server = uvicorn.Server(uvicorn.Config(
                app or create_app(self.orch, MODEL, **kw), host="127.0.0.1", port=0,
                log_config=None, access_log=False, lifespan="off"))
            task = asyncio.ensure_future(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            self.servers.append((server, task))
            return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

        return self.call(start())

    def stop(self) -> None:
        from orchestrator.pair import close

        async def stop():
            for server, _ in self.servers:
                server.should_exit = True
            await asyncio.gather(*(task for _, task in self.servers), return_exceptions=True)
            await close(self.orch)

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


async def generate_on(services, draft_key, prompt, mode, k, max_new=40, sampling=None, hook=None,
                      decode_on=0):
    """One generation over the services (draft_key None: target-only); its result. hook(n)
    is awaited after the n-th streamed delta. ``decode_on`` 0 by default: on the tiny models
    a call costs more than a pass, so with decoding on adaptive k would rightly never draft,
    and the tests of speculation here need it to (tests/test_decode_on.py tests decoding on)."""
    from orchestrator.generation import GenerationRequest
    from orchestrator.pair import close, connect
    from specdec.config import SamplingParams

    draft = services[draft_key].address if draft_key else None
    orch = await connect(services["target"].address, draft, tokenizer_spec="default",
                         decode_on=decode_on)
    try:
        req = GenerationRequest(prompt, max_new, sampling or SamplingParams(), [], mode, k)
        result = None
        n = 0
        async for item in orch.stream(req):
            if hasattr(item, "stats"):
                result = item
            else:
                n += 1
                if hook:
                    await hook(n)
        return result
    finally:
        await close(orch)


KEY = "sekret"  # the API key of serve_with_key


def child_pids(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    from bench.faults import children

    return {child for child, _ in children(pid)}


@pytest.fixture(scope="module")
def serve_with_key(tmp_path_factory):
    """`specdec serve` on the real default pair (it starts its services), with API key KEY:
    (process, base URL, log path). Float numerics, so that answers are HF's greedy text
    (tests/test_real_pair.py checks the default, integer, against specdec target-only)."""
    d = tmp_path_factory.mktemp("serve")
    port_file, log_path = d / "port", d / "log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--port-file",
             str(port_file), "--api-key", KEY, "--numerics", "float"], stdout=log,
            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{wait_for_port_file(proc, port_file, log_path, 900)}"
        yield proc, url, log_path
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM (a server's clean shutdown), then SIGKILL if it has not exited in ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape(url: str, **kw) -> dict:
    """/metrics as {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(url + "/metrics", **kw).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


# ---- the cost model's tests (test_costs, test_adaptive_priors) ---------------------------
# T(m) ms, m = 1..16, as calibrated on a 2-core CPU: flat to m ~ 6, then ~1 ms per token
CURVE = [30.0, 31, 31, 31, 31, 32, 33, 35, 36, 37, 38, 39, 40, 41, 43, 44]


def call_record(service, compute_ms, tokens, sent=1, rpc_extra_ms=2.0, batch=1, outcome="ok",
                re_prefilled=False, pass_tokens=0, queued_ms=0.0, after_draft=False):
    """A call of ``compute_ms`` that took ``queued_ms`` (its wait in the service) +
    ``rpc_extra_ms`` more."""
    from orchestrator.service_clients import CallRecord
    return CallRecord(service, 0.0, (compute_ms + queued_ms + rpc_extra_ms) / 1000.0,
                      compute_ms, tokens, outcome, re_prefilled, batch, sent,
                      pass_tokens=pass_tokens, queued_ms=queued_ms, after_draft=after_draft)


def live_costs():
    from orchestrator.adaptive import Costs, LiveCosts
    return LiveCosts(**vars(Costs.calibrated(CURVE, [3.0])))


CPU_LINE = [46.0 + 6.0 * m for m in range(16)]
FLAT = [10.0] * 48 + [10.0 + 0.1 * m for m in range(1, 17)]  # a GPU's: flat to 48


def pipelined_controller(curve, batch, cache_hit, draft=(6.0,)):
    """A pipelined controller with the speculation cache, whose draft's pass over m rows
    costs draft[m - 1] ms."""
    from orchestrator.adaptive import Costs, KController
    costs = Costs.calibrated(curve, list(draft))
    costs.target_batch = batch
    ctl = KController(curve, list(draft[:1]), pipelined=True, costs=costs)
    ctl.branching, ctl.cache_hit = True, cache_hit
    return ctl


# ---- the HTTP front's tests (test_api, test_api_serving, test_api_logprobs) ---------------
PROMPT = "What is the capital of France?"
PROMPTS = [PROMPT, "Write a short poem about the sea.", "List three fruits."]


@pytest.fixture(scope="module")
def host(tiny_services):
    """Pipelined over the tiny target and a disagreeing draft: rejections and rollbacks."""
    h = ApiHost(tiny_services["target"].address, tiny_services["draft"].address)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def api(host) -> str:
    return host.serve()


@pytest.fixture(scope="module")
def tok():
    from specdec.models.hub import load_tokenizer
    return load_tokenizer("default")


def chat_ids(tok, content: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(tiny_models, tok, prompt_ids: list[int], n: int) -> tuple[str, list[int]]:
    """Target-only greedy text and ids from transformers (stops after EOS)."""
    ids = hf_greedy(tiny_models["target"], prompt_ids, n)
    return tok.decode(ids, skip_special_tokens=True), ids


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


# Scheduler works for tests that drive a BatchScheduler directly.

class StepWork:
    """One decoding step of a session: a 1-token piece on its own cache."""

    def __init__(self, session_id, cache, token):
        self.session_id, self.cache, self.cancelled = session_id, cache, False
        self.compute_s, self.batch_size, self.pass_tokens, self.queued_s = 0.0, 0, 0, 0.0
        self.tokens = torch.tensor([token])

    def start(self):
        pass

    def next_piece(self, budget):
        from specdec.serving.scheduler import Piece
        return Piece(self.cache, self.tokens, 1, prefill=False)

    def consume(self, logits):
        return True

    def result(self):
        return self.queued_s


class BlockWork(StepWork):
    """A verify-like call: ``n`` tokens on its session's cache in one piece, all logits."""

    def __init__(self, session_id, cache, tokens):
        super().__init__(session_id, cache, 0)
        self.tokens, self.logits = tokens, None

    def next_piece(self, budget):
        from specdec.serving.scheduler import Piece
        return None if self.logits is not None else \
            Piece(self.cache, self.tokens, int(self.tokens.shape[0]), prefill=False)

    def consume(self, logits):
        self.logits = logits
        return True

    def result(self):
        return self.logits
