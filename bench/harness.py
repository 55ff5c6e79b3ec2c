"""The systems ``specdec bench`` compares, each run on the same prompts, interleaved.

HF systems run in this process (transformers ``generate``); specdec systems talk to local
service processes (one torch thread each by default). Every prompt is run by every system in
turn, so machine drift hits all systems alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pathlib

from orchestrator.generation import DECODE_ON
from specdec.config import DEFAULT_NUMERICS
from bench.llamacpp import SYSTEMS as LLAMACPP_SYSTEMS
from specdec.models.hf_generate import SYSTEMS as HF_SYSTEMS

log = logging.getLogger(__name__)

PROMPT_DIR = pathlib.Path(__file__).parent / "prompts"
PROMPT_SETS = {"default": PROMPT_DIR / "default.jsonl", "grounded": PROMPT_DIR / "grounded.jsonl"}

SPECDEC_SYSTEMS = ("specdec-target-only", "specdec-spec", "specdec-pipelined",
                   "specdec-pipelined-plain", "specdec-ngram")
# Drafted by the target's own int8 copy (draft "int8:<target>") instead of --draft: run when
# named in --systems (a second target-sized service).
INT8_SYSTEMS = ("specdec-spec-int8", "specdec-pipelined-int8", "specdec-pipelined-int8-plain")
# Target-only with one round trip per token (decode_on = 0): what decoding on saves, when named
STEPWISE_SYSTEMS = ("specdec-target-only-stepwise",)
# system -> (orchestrator, mode, speculation cache); "-plain": pipelining's single guess only
SPECDEC_RUNS = {
    "specdec-target-only": ("target", "target-only", True),
    "specdec-target-only-stepwise": ("stepwise", "target-only", True),
    "specdec-spec": ("draft", "spec", True),
    "specdec-pipelined": ("draft", "pipelined", True),
    "specdec-pipelined-plain": ("draft", "pipelined", False),
    "specdec-ngram": ("ngram", "pipelined", True),
    "specdec-spec-int8": ("int8", "spec", True),
    "specdec-pipelined-int8": ("int8", "pipelined", True),
    "specdec-pipelined-int8-plain": ("int8", "pipelined", False),
}
DEFAULT_SYSTEMS = HF_SYSTEMS + SPECDEC_SYSTEMS
# llama.cpp on the target's GGUF file: run when named (an optional package, bench/llamacpp.py)
ALL_SYSTEMS = DEFAULT_SYSTEMS + INT8_SYSTEMS + STEPWISE_SYSTEMS + LLAMACPP_SYSTEMS
# systems the orchestrator does not run, each with its own runner's (tokens, wall) ``run``
EXTERNAL_SYSTEMS = HF_SYSTEMS + LLAMACPP_SYSTEMS
BASELINE = "hf"
# Split: the draft services' CPU priority below the orchestrator's on the cores they share
DRAFT_NICE = 10


def load_prompts(spec: str) -> list[str]:
    """A prompt set by name (default, grounded) or a file (.jsonl with "prompt", or .txt)."""
    path = PROMPT_SETS.get(spec, pathlib.Path(spec))
    text = pathlib.Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [line for line in text.splitlines() if line.strip()]


@dataclasses.dataclass
class Run:
    system: str
    prompt_set: str
    prompt_index: int
    token_ids: list[int]
    wall_s: float
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_busy_s: float = 0.0
    verify_busy_s: float = 0.0
    k_mean: float = 0.0
    tokens_per_round: list[int] = dataclasses.field(default_factory=list)
    timeline: list[tuple[str, float, float, str]] = dataclasses.field(default_factory=list)
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    branches: int = 0  # speculation-cache branches drafted
    lookup_rounds: int = 0  # rounds whose block came from prompt lookup, not the draft model


def system_name(system: str, rtt_ms: float | None) -> str:
    """A system's name in the results, with the added round trip when there is one."""
    return system if not rtt_ms else f"{system}@rtt{rtt_ms:g}ms"


class SpecdecSystems:
    """Local target + model draft + n-gram draft services, and an orchestrator per pair."""

    def __init__(self, target: str, draft: str, threads: int, systems: list[str],
                 cores: dict[str, list[int]] | None = None, rtts: list[float] = (0.0,),
                 decode_on: int = DECODE_ON, numerics: str = DEFAULT_NUMERICS,
                 prompt_lookup: bool = True):
        """``cores``: {"target": [...], "draft": [...]} to pin each service (split topology;
        threads then default to the cores given). ``rtts``: round trips in ms added between
        the orchestrator and every service (a delaying proxy per service and value).
        ``decode_on``: the orchestrators' (--decode-on; the -stepwise system's is 0).
        ``numerics``: every service's (--numerics; what runs decides ``self.reference``).
        ``prompt_lookup``: False drafts every block with the draft model (--no-prompt-lookup:
        its acceptance alone, as `specdec generate --no-prompt-lookup`)."""
        from orchestrator.local import ServiceProcess, service_args

        self.decode_on, self.prompt_lookup = decode_on, prompt_lookup
        cores = cores or {}

        def args(role, model, extra=()):
            n = threads or len(cores.get(role, ())) or 0
            return service_args(model, n, ["--numerics", numerics, *extra])

        wanted = {"target": ("target", args("target", target))}
        if any(SPECDEC_RUNS[s][0] == "draft" for s in systems if s in SPECDEC_RUNS):
            wanted["draft"] = ("draft", args("draft", draft, ["--target", target]))
        if "specdec-ngram" in systems:
            wanted["ngram"] = ("draft", args("draft", "ngram", ["--target", target]))
        if set(INT8_SYSTEMS) & set(systems):
            wanted["int8"] = ("draft", args("draft", f"int8:{target}", ["--target", target]))
        self.processes = {}
        self.proxies = []
        try:
            for name, (role, a) in wanted.items():  # one at a time: see LocalServices
                # Split, the orchestrator (this process) runs on the draft's cores: the draft
                # yields them to it (deployed, they share no CPU; at equal priority a draft
                # call's compute delayed the orchestrator's next verify sends, and sessions
                # missed the target's batched pass).
                self.processes[name] = ServiceProcess(
                    role, a, cores=cores.get(role),
                    nice=DRAFT_NICE if cores and role == "draft" else 0)
                self.processes[name].wait_port()
        except BaseException:
            for p in self.processes.values():
                p.stop()
            raise
        self.target_spec = target
        self.split = bool(cores)
        self.cores = cores
        self.rtts = list(rtts)
        self.orchestrators: dict[tuple[str, float], object] = {}
        self.loop = asyncio.new_event_loop()

    def connect(self) -> None:
        from bench.netdelay import DelayProxy
        from orchestrator.pair import connect

        def via(address: str, rtt: float) -> str:
            if not rtt:
                return address
            proxy = DelayProxy(address, rtt)
            self.proxies.append(proxy)
            return proxy.address

        if self.split:
            # The orchestrator (this thread, and the gRPC threads its channels start) runs
            # beside the draft, so the target's cores are the target's alone, as they are the
            # HF baselines' (which pin themselves there for each run). Deployed, the
            # orchestrator has hardware of its own.
            os.sched_setaffinity(0, self.cores["draft"])
        pairs = {"target": None, "stepwise": None, "draft": "draft", "ngram": "ngram",
                 "int8": "int8"}
        for rtt in self.rtts:
            t = via(self.processes["target"].address, rtt)
            for name, draft_key in pairs.items():
                if draft_key is not None and draft_key not in self.processes:
                    continue
                d = via(self.processes[draft_key].address, rtt) if draft_key else None
                steps = 0 if name == "stepwise" else self.decode_on
                orch = self.loop.run_until_complete(connect(  # shared_cores: see Orchestrator
                    t, d, tokenizer_spec=self.target_spec, shared_cores=not self.split,
                    decode_on=steps))
                self.orchestrators[(name, rtt)] = orch

    @property
    def reference(self) -> str:
        """The system whose greedy text every specdec system must equal: "hf" where the target
        computes float (transformers' numbers), "specdec-target-only" where it computes
        integer numerics (a GGUF target on CPU)."""
        numerics = self.orchestrators[("target", self.rtts[0])].target.info.numerics
        return "hf" if numerics == "float" else "specdec-target-only"

    @property
    def target_forward_ms(self) -> list[float]:
        return list(self.orchestrators[("target", self.rtts[0])].target.info.forward_ms)

    def run(self, system: str, prompt_ids: list[int], max_new: int, k: int | None,
            sampling=None, rtt: float | None = None) -> Run:
        from orchestrator.generation import GenerationRequest
        from specdec.config import SamplingParams

        orch, mode, branches = SPECDEC_RUNS[system]
        rtt = self.rtts[0] if rtt is None else rtt
        req = GenerationRequest(prompt_ids, max_new, sampling or SamplingParams(), mode=mode, k=k,
                                branches=branches, prompt_lookup=self.prompt_lookup)
        result = self.loop.run_until_complete(self.orchestrators[(orch, rtt)].generate(req))
        s = result.stats
        split = s.time_split()
        t0 = min((c.start for c in s.calls), default=0.0)
        return Run(
            system=system_name(system, rtt), prompt_set="", prompt_index=-1,
            token_ids=result.token_ids, wall_s=s.wall_s, rounds=s.rounds,
            draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
            draft_busy_s=split["draft_s"], verify_busy_s=split["verify_s"], k_mean=s.k_mean,
            tokens_per_round=list(s.tokens_per_round),
            timeline=[(c.service, c.start - t0, c.end - t0, c.outcome) for c in s.calls],
            pipeline_hits=s.pipeline_hits, pipeline_misses=s.pipeline_misses,
            branches=s.branches_drafted, lookup_rounds=s.lookup_rounds,
        )

    def close(self) -> None:
        from orchestrator.pair import close

        for orch in self.orchestrators.values():
            self.loop.run_until_complete(close(orch))
        self.loop.close()
        for proxy in self.proxies:
            proxy.close()
        for p in self.processes.values():
            p.stop()
