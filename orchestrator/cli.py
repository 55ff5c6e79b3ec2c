"""The ``specdec`` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys

from orchestrator.generation import DECODE_ON, DEFAULT_MODE, MODES
from specdec.config import DEFAULT_DTYPE, DEFAULT_NUMERICS, DEFAULT_RULE, DTYPES, NUMERICS, RULES
from specdec.models.tokenizer import encode_prompt

log = logging.getLogger(__name__)

AUTO_MODE = "auto"  # the CLI's --mode default: settled per run by resolve_auto


def shares_compute(args) -> bool:
    """True when specdec starts both services itself, on this machine's cores.

    Then draft and target compete for the same compute, and overlapping them (pipelined) only
    splits it: measured on a 2-core CPU, sequential rounds with all cores per service beat
    pipelined rounds with one core each (docs/performance.md). Pipelining pays when the draft has
    its own hardware: services at --draft-addr / --target-addr, or a Ray/Kubernetes deployment.
    """
    return args.target_addr is None and args.draft_addr is None


def resolve_auto(args) -> None:
    """Settle ``--mode auto`` and ``--threads 0`` (auto) for this run, in place."""
    cores = os.cpu_count() or 1
    if args.mode == AUTO_MODE:
        args.mode = "spec" if shares_compute(args) else DEFAULT_MODE
    if not args.threads:
        # Local services take turns in spec / target-only mode, so each may use every core;
        # pipelined local services run at the same time, so they split the cores.
        args.threads = max(1, cores // 2) if args.mode == "pipelined" else cores


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rule", choices=RULES, default=DEFAULT_RULE,
                   help="acceptance rule when sampling (temperature > 0): coupled (default): "
                        "the same seed gives the same text in every mode and at any k; "
                        "rejection: higher acceptance, text depends on the draft and k")
    p.add_argument("--k", type=int, default=None,
                   help="draft tokens per round (default: adaptive; 0 = no speculation)")
    p.add_argument("--mode", choices=[AUTO_MODE, *MODES], default=AUTO_MODE,
                   help="pipelined: draft ahead during verification; spec: sequential rounds; "
                        "target-only: no draft, the baseline; auto (default): spec when specdec "
                        "starts both services on this machine (they share its cores), pipelined "
                        "when they run elsewhere (--target-addr / --draft-addr)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                   help="draft with the draft model only (default: a block is first looked up "
                        "in the prompt and the text so far)")


def add_pair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default",
                   help="target model: 'default' (SmolLM2-135M-Instruct), a .gguf file or a "
                        "Hugging Face directory")
    p.add_argument("--draft", default="default-draft",
                   help="draft model: 'default-draft' (shipped for the default target; for "
                        "another target, its int8 copy), 'int8:<spec>' (that model with int8 "
                        "weights: 'int8:default' drafts with the target's own weights, "
                        "~0.95 of its greedy tokens, for separate CPU hardware), 'ngram' "
                        "(prompt lookup), a specdec draft directory (a plain or a "
                        "feature-conditioned draft: specdec distill-feature export), .gguf or "
                        "HF directory")
    p.add_argument("--target-addr", help="HOST:PORT of a running target service")
    p.add_argument("--draft-addr", help="HOST:PORT of a running draft service")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per local service (default 0 = auto: every core each "
                        "in spec mode, half each in pipelined mode)")
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="local services' CPU numerics on a quantized (GGUF) model: integer "
                        "(llama.cpp's int8 dot products, a position's logits the same bits in "
                        "any pass) or float (float32 on the weights the codes encode, "
                        "transformers' numbers within rounding); default %(default)s")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help="local services' weights, activations and KV cache: auto (default: "
                        "bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    p.add_argument("--tokenizer", help="tokenizer for prompts (default: the --target model)")
    p.add_argument("--tls-ca", help="TLS to the services: the CA that signed their certificates "
                                    "(without it, the system's roots)")
    p.add_argument("--tls-cert", help="client certificate for mutual TLS (enables TLS)")
    p.add_argument("--tls-key", help="client key for mutual TLS")
    p.add_argument("--tls-server-name", help="expected server name in the certificates")
    p.add_argument("--decode-on", type=int, default=DECODE_ON, metavar="N",
                   help="plain target steps per call in a round with no draft block "
                        "(target-only, k = 0): the target decodes on by itself and the text "
                        "streams every N + 1 tokens (default %(default)s; 0: a round trip per "
                        "token)")
    p.add_argument("--target-deadline-s", type=float, default=0.0,
                   help="how long a request waits for a target that is down (dead, "
                        "restarting, loading) to come back before failing with UNAVAILABLE / "
                        "HTTP 503 (default %(default)s: fail at once; clients retry 503)")


def tls_from_args(args) -> dict | None:
    """The channels' TLS settings (for orchestrator.pair.connect), or None for plaintext.

    Any of --tls-ca / --tls-cert turns TLS on: a client certificate must never travel over a
    channel that silently fell back to plaintext.
    """
    ca, cert, key = (getattr(args, f"tls_{x}", None) for x in ("ca", "cert", "key"))
    if not (ca or cert or key):
        if getattr(args, "tls_server_name", None):
            raise ValueError("--tls-server-name needs TLS: give --tls-ca (and for mutual TLS "
                             "--tls-cert/--tls-key)")
        return None
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key must be given together (mutual TLS)")
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path}")
    return dict(ca=ca, cert=cert, key=key, server_name=args.tls_server_name)


def read_prompt_file(path: str) -> list[str | list[dict]]:
    """Prompts from a file: JSONL (a "prompt" string or a "messages" list per line, so prompts
    may span lines and hold whole chats) when it ends in .jsonl, else one prompt per line."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not path.endswith(".jsonl"):
        return lines
    prompts: list[str | list[dict]] = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object: {exc}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and _is_chat(row.get("messages")):
            prompts.append(row["messages"])
        else:
            raise ValueError(f'{path}:{n}: each line needs a "prompt" string or a "messages" '
                             f'list of {{"role", "content"}} objects')
    return prompts


def _is_chat(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages)


@contextlib.asynccontextmanager
async def orchestrator_for(args, need_draft: bool = True):
    """An Orchestrator over the services the flags name: running ones (``--target-addr`` /
    ``--draft-addr``) or local ones started for the run and stopped after it."""
    from orchestrator.local import LocalServices
    from orchestrator.pair import close, connect

    target_addr, draft_addr = args.target_addr, args.draft_addr
    want_draft = need_draft and args.mode != "target-only"
    tls = tls_from_args(args)
    start_local = target_addr is None or (want_draft and draft_addr is None)
    if tls and start_local:
        raise ValueError("the --tls-* flags secure the channels to running services: give "
                         "--target-addr and --draft-addr (local services listen on "
                         "loopback without TLS)")
    local = None
    # the draft computes as the target does: a self-draft then agrees with it bit for bit
    model_args = ["--numerics", getattr(args, "numerics", DEFAULT_NUMERICS),
                  "--dtype", getattr(args, "dtype", DEFAULT_DTYPE)]
    if start_local:
        local = LocalServices(target=args.target,
                              draft=args.draft if want_draft and draft_addr is None else None,
                              threads=args.threads, target_args=model_args,
                              draft_args=model_args)
    orch = None
    try:
        if local is not None:
            await asyncio.get_running_loop().run_in_executor(None, local.__enter__)
            target_addr = target_addr or local.target_addr
            draft_addr = draft_addr or local.draft_addr
        # Services specdec started here share this machine's cores with each other.
        orch = await connect(target_addr, draft_addr if want_draft else None,
                             target_deadline_s=args.target_deadline_s,
                             tokenizer_spec=args.tokenizer or args.target, tls=tls,
                             shared_cores=start_local, decode_on=args.decode_on)
        if local is not None:  # restart a service that dies, and tell the orchestrator
            loop = asyncio.get_running_loop()
            local.supervise(lambda role, event, detail: loop.call_soon_threadsafe(
                orch.service_event, role, event, detail))
        yield orch
    finally:
        if orch is not None:
            await close(orch)
        if local is not None:
            local.stop()


def cmd_generate(args) -> int:
    from orchestrator.generation import GenerationRequest
    from specdec.config import SamplingParams

    prompts = []
    if args.prompt_file:
        try:
            prompts = read_prompt_file(args.prompt_file)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {exc}")
    if args.prompt:
        prompts.insert(0, args.prompt)
    if not prompts:
        raise SystemExit("error: give a PROMPT or --prompt-file")
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                                  args.rule)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")

    resolve_auto(args)

    async def run() -> None:
        async with orchestrator_for(args) as orch:
            if args.compare:  # as `specdec bench` does: no system timed on its first pass
                warm = encode_prompt(orch.tokenizer, "Hello!", args.chat)
                for mode in (args.mode, "target-only"):
                    await orch.generate(GenerationRequest(warm, 8, sampling, [], mode, args.k))
            for prompt in prompts:
                ids = encode_prompt(orch.tokenizer, prompt, args.chat)
                req = GenerationRequest(ids, args.max_new_tokens, sampling, args.stop,
                                        args.mode, args.k, prompt_lookup=args.prompt_lookup)
                if args.json:
                    result = await orch.generate(req)
                    out = result.summary()
                    out["prompt"] = prompt
                    print(json.dumps(out), flush=True)
                    continue
                async for item in orch.stream(req):
                    if hasattr(item, "text") and not hasattr(item, "stats"):
                        print(item.text, end="", flush=True)
                    else:
                        result = item
                s = result.summary()
                print(
                    f"\n\n[{s['mode']}] {s['completion_tokens']} tokens in {s['wall_s']:.2f}s "
                    f"({s['tokens_per_s']:.1f} tok/s) | rounds {s['rounds']} | acceptance "
                    f"{s['acceptance_rate']:.2f} | tokens/round {s['mean_tokens_per_round']:.2f} | "
                    f"k mean {s['k_mean']:.2f} | overlap {s['overlap_efficiency']:.2f}",
                    file=sys.stderr, flush=True,
                )
                if args.compare:
                    await compare_with_target_alone(orch, req, result, args)

    try:
        asyncio.run(run())
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    return 0


async def compare_with_target_alone(orch, req, result, args) -> None:
    """Run the same request on the target alone, through specdec's target-only path and (greedy)
    through plain transformers ``generate``, and print the speeds side by side."""
    import dataclasses

    from specdec.models.hf_generate import HFGenerate

    alone = await orch.generate(dataclasses.replace(req, mode="target-only", k=None))
    rows = [(f"speculative ({result.stats.mode})", result.token_ids, result.stats.wall_s),
            ("target alone (specdec target-only)", alone.token_ids, alone.stats.wall_s)]
    if req.sampling.greedy:
        hf = HFGenerate(args.tokenizer or args.target, None, 0)
        tokens, wall = hf.run("hf", req.prompt_ids, req.max_new_tokens)
        rows.append(("target alone (transformers generate)", tokens, wall))
    width = max(len(name) for name, _, _ in rows)
    print("\nthe same prompt on the target alone:", file=sys.stderr)
    for name, tokens, wall in rows:
        print(f"  {name:<{width}}  {len(tokens):4d} tokens  {len(tokens) / wall:6.1f} tok/s",
              file=sys.stderr)
    speed = [len(t) / w for _, t, w in rows]
    line = f"speedup {speed[0] / speed[1]:.2f}x over the target alone through specdec"
    if len(rows) > 2:
        line += f", {speed[0] / speed[2]:.2f}x over transformers generate"
    if req.sampling.drafter_invariant:
        # transformers computes float32: the reference only where the target does too
        exact = rows if orch.target.info.numerics != "integer" else rows[:2]
        same = all(tokens == result.token_ids for _, tokens, _ in exact)
        runs = "every run" if len(exact) == len(rows) else "both specdec runs"
        line += (f"; generated tokens identical in {runs}" if same else
                 "; WARNING: the texts differ (see the exactness notes in docs/design.md)")
        if len(exact) < len(rows):
            theirs, ours = rows[2][1], result.token_ids
            agree = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b),
                         min(len(theirs), len(ours)))
            line += (f" (the target computes integer numerics, transformers float32: their "
                     f"texts agree on the first {agree} tokens; --numerics float gives "
                     f"transformers' numbers)")
    else:
        line += ("; sampled texts differ between modes under the rejection rule (the same "
                 "distribution, not the same draw)")
    print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from draft_service import server as draft_server
    from target_service import server as target_server

    parser = argparse.ArgumentParser(
        prog="specdec", description="Distributed speculative decoding over gRPC services.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", help="the prompt (or use --prompt-file)")
    g.add_argument("--prompt-file", help="one prompt per line, or .jsonl: a \"prompt\" or a "
                                         "\"messages\" (chat) field per line")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default for chat models)")
    g.add_argument("--no-chat", dest="chat", action="store_false")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.add_argument("--compare", action="store_true",
                   help="also run each prompt on the target alone (specdec target-only, and "
                        "transformers generate when greedy) and print the speedup")
    add_generation_arguments(g)
    add_pair_arguments(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("serve-draft", help="run the draft service in the foreground")
    draft_server.add_arguments(d)
    d.set_defaults(func=draft_server.run)

    t = sub.add_parser("serve-target", help="run the target service in the foreground")
    target_server.add_arguments(t)
    t.set_defaults(func=target_server.run)

    for register in _extensions():
        register(sub)
    return parser


def _extensions():
    """Subcommands that live in their own modules."""
    import importlib

    for module in ("orchestrator.serve_cli", "bench.cli", "specdec.distill.cli",
                   "orchestrator.ray.cli"):
        yield importlib.import_module(module).register


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in ("serve-draft", "serve-target"):
        logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
