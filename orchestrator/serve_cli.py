"""``specdec serve``: the OpenAI-compatible HTTP server (uvicorn) over a draft/target pair."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys


def register(subparsers) -> None:
    from orchestrator.cli import add_generation_arguments, add_pair_arguments

    s = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                    "/metrics. Without --target-addr/--draft-addr the two services are started "
                    "as local processes. The generation flags are the defaults for what a "
                    "request leaves out (but --seed: a request without a seed gets a fresh "
                    "one).")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 = a free port (see --port-file)")
    s.add_argument("--port-file", help="write the bound port to this file once serving")
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health "
                        "(default: $SPECDEC_API_KEY; unset = no key)")
    s.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    s.add_argument("--model-name", default="specdec",
                   help="the model id clients send and /v1/models lists")
    s.add_argument("--log-level", default="INFO",
                   help="INFO logs one line per request (default)")
    s.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                   help="larger request bodies get HTTP 413 (default: 2 MiB)")
    s.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request body not all in this many seconds after its headers gets "
                        "HTTP 408 and its connection is closed (default: 30)")
    s.add_argument("--header-timeout-s", type=float, default=20.0,
                   help="a connection whose request line and headers are not all in this "
                        "many seconds after their first byte (or the connection's opening) "
                        "is closed (default: 20, as Apache's)")
    s.add_argument("--max-header-bytes", type=int, default=32 * 1024,
                   help="a larger request line and headers, in all, get HTTP 431 and the "
                        "connection is closed (default: 32 KiB, nginx's 4 x 8k buffers)")
    add_generation_arguments(s)
    add_pair_arguments(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from orchestrator.cli import orchestrator_for, resolve_auto
    from orchestrator.http.app import create_app
    from orchestrator.http.connection import HeadLimit
    from orchestrator.http.schemas import ServeDefaults

    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise SystemExit("error: --ssl-certfile and --ssl-keyfile must be given together")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"error: {flag}: no such file: {path}")
    scheme = "https" if args.ssl_certfile else "http"
    resolve_auto(args)
    try:
        defaults = ServeDefaults(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, rule=args.rule,
                                 mode=args.mode, k=args.k,
                                 stop=list(args.stop), max_body_bytes=args.max_body_bytes,
                                 body_timeout_s=args.body_timeout_s,
                                 prompt_lookup=args.prompt_lookup)
        http = HeadLimit.factory(args.header_timeout_s, args.max_header_bytes)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")

    class Server(uvicorn.Server):
        # uvicorn re-raises SIGINT/SIGTERM after its shutdown, which would end the process
        # before orchestrator_for stops the local services: serve() below handles the signals instead.
        def capture_signals(self):
            return contextlib.nullcontext()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        server: Server | None = None

        def on_signal() -> None:
            if server is None:
                main.cancel()  # still starting: orchestrator_for stops what it started
            elif server.should_exit:
                server.force_exit = True  # a second signal: do not wait for open requests
            else:
                server.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        async with orchestrator_for(args) as orch:
            app = create_app(orch, args.model_name, api_key=args.api_key, defaults=defaults)
            # Our logging config and per-request line (orchestrator.http.app), not uvicorn's.
            config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                    access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5, http=http,
                                    # h11 (uvicorn's parser without httptools) keeps its own
                                    # bound on a head still incomplete after a read: ours
                                    h11_max_incomplete_event_size=args.max_header_bytes,
                                    ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
            server = Server(config)
            task = asyncio.ensure_future(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                port = server.servers[0].sockets[0].getsockname()[1]
                if args.port_file:
                    tmp = args.port_file + ".tmp"
                    with open(tmp, "w") as f:
                        f.write(str(port))
                    os.replace(tmp, args.port_file)  # readers never see a partial file
                print(f"specdec serve: model {args.model_name!r} on "
                      f"{scheme}://{args.host}:{port}/v1", file=sys.stderr, flush=True)
            await task

    try:
        asyncio.run(serve())
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    except asyncio.CancelledError:
        raise SystemExit("specdec serve: interrupted while starting")
    return 0
