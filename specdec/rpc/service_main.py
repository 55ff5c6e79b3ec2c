"""The one entry point of both model services: their flags, logging, and ``serve``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from typing import Callable

from specdec.config import DEFAULT_DTYPE, DEFAULT_NUMERICS, DTYPES, NUMERICS, ServiceConfig
from specdec.rpc.transport import DEFAULT_MAX_MESSAGE_BYTES
from specdec.serving.kernels import KERNEL_CHOICES


def configure_logging(level: str = "INFO") -> None:
    """Entry points only: one line per event, with the logger's name."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def add_service_arguments(parser, default_model: str) -> None:
    """Command-line flags of a model service (serve-draft / serve-target)."""
    parser.add_argument("--model", default=default_model, help="model spec (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port")
    parser.add_argument("--port-file", help="write the bound port here once ready")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--cache-cap-mb", type=int, default=0,
                        help="KV cache memory of all sessions (0 = on a GPU the memory free "
                             "after the weights less 1 GiB, on a CPU 1024)")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--session-ttl-s", type=float, default=600.0)
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=0.0,
                        help="starting from idle, wait this long for other calls to join the "
                             "first pass (default 0: later calls join the next pass anyway)")
    parser.add_argument("--regroup-ms", type=float, default=ServiceConfig.regroup_ms,
                        help="after a pass, wait up to this long for the sessions it answered "
                             "to send their next calls, so concurrent sessions share passes "
                             "(0: never wait)")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="prompt tokens of a pass no other session waits on")
    parser.add_argument("--prefill-share", type=float, default=0.5,
                        help="what a long prompt's prefill may add to a pass another session "
                             "waits on, as a share of a decode-only pass (default %(default)s: "
                             "a session decoding beside it keeps ~2/3 of its speed)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="CPU linear kernels: auto times oneMKL (as stored and on the "
                             "transposed weight, mkl-t) and prepacked oneDNN at start and keeps "
                             "the fastest at each number of rows (default)")
    parser.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                        help="how quantized (GGUF-coded) linear layers compute on CPU: "
                             "integer (llama.cpp's int8 dot products: every position's logits "
                             "the same bits in any pass) or float (float32 on the weights the "
                             "codes encode, transformers' numbers within rounding); default "
                             "%(default)s")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help="weights, activations and KV cache: auto (default: bfloat16 on "
                             "CUDA, float32 on CPU, where specdec's kernels are float32), "
                             "float32, bfloat16 or float16; logits, sampling and acceptance are "
                             "float32 whatever it is")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-client-ca", help="require client certificates (mutual TLS)")
    parser.add_argument("--log-level", default="INFO")


def service_config_from_args(args, role: str) -> ServiceConfig:
    try:
        return ServiceConfig(
            model=args.model, role=role, host=args.host, port=args.port, device=args.device,
            threads=args.threads, cache_cap_mb=args.cache_cap_mb, max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s, max_message_bytes=args.max_message_bytes,
            max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
            regroup_ms=args.regroup_ms,
            prefill_chunk=args.prefill_chunk, prefill_share=args.prefill_share,
            kernels=args.kernels, numerics=args.numerics, dtype=args.dtype,
            calibrate=not args.no_calibrate, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")


PARENT_ENV = "SPECDEC_PARENT_PID"  # set by orchestrator.local for the services it starts


def exit_with_parent(poll_s: float = 1.0) -> None:
    """When a local starter (``specdec serve`` / ``generate``, orchestrator.local) names
    itself in SPECDEC_PARENT_PID, stop this service once that process is gone, as SIGTERM
    would: a killed starter leaves no services behind."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        logging.getLogger(__name__).warning("the process that started this service is gone; "
                                            "stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def serve(args, make_host: Callable, role: str, **host_args) -> None:
    """Run a model service until it is terminated: ``make_host(config, **host_args)`` builds its
    ServiceHost (inside the running event loop, where the aio server must be made)."""
    configure_logging(args.log_level)
    config = service_config_from_args(args, role=role)
    exit_with_parent()

    async def serve_forever() -> None:
        await make_host(config, **host_args).serve_forever(args.port_file)

    asyncio.run(serve_forever())


def main(argv, prog: str, description: str, add_arguments: Callable, run: Callable) -> None:
    """``python -m draft_service`` / ``target_service``: parse the flags, then ``run(args)``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    run(parser.parse_args(argv))
