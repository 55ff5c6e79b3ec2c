"""gRPC plumbing shared by the two services and the orchestrator's channels.

The only module of the core that knows about the network: server and channel options (message
size limits, keepalive), TLS / mutual TLS credentials, the standard health service and
reflection, and the mapping from core errors to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.session import PrefixMismatch, SessionNotFound

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple]:
    """Client side: message limits, and keepalive pings so a dead peer is noticed in ~40 s."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple]:
    """Server side: message limits, and accept the clients' keepalive pings (the default
    policy answers pings more often than every 5 minutes with GOAWAY "too_many_pings")."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def server_credentials(cert: str, key: str, client_ca: str | None = None):
    """TLS server credentials; with ``client_ca`` clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(client_ca),
        require_client_auth=client_ca is not None,
    )


def channel_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None):
    """TLS channel credentials: ``ca`` to trust the server, ``cert``/``key`` for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def aio_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: dict | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to a service; ``tls`` = dict(ca=..., cert=..., key=..., server_name=...)."""
    options = channel_options(max_message_bytes)
    if tls:
        if tls.get("server_name"):
            options.append(("grpc.ssl_target_name_override", tls["server_name"]))
        creds = channel_credentials(tls.get("ca"), tls.get("cert"), tls.get("key"))
        return grpc.aio.secure_channel(address, creds, options=options)
    return grpc.aio.insecure_channel(address, options=options)


class HealthReporter:
    """The standard gRPC health service, NOT_SERVING until the model is ready."""

    def __init__(self, server: grpc.aio.Server, service_names: list[str]):
        self.servicer = health.aio.HealthServicer()
        self.names = ["", *service_names]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.names:
            await self.servicer.set(name, status)


def enable_reflection(server: grpc.aio.Server, full_service_names: list[str]) -> None:
    reflection.enable_server_reflection([*full_service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)


class _Undecodable:
    """What a request that is not a valid protobuf message decodes to (see DecodeGuard)."""

    def __init__(self, error: Exception):
        self.message = f"the request is not a valid protobuf message: {error}"


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT to bytes that do not parse as the method's request message.

    gRPC itself would answer UNKNOWN and log a traceback per message; corrupt bytes are bad
    input like any other. The deserializer returns a marker instead of raising, and the
    handler aborts on it before the servicer sees it.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # DecodeError, bad UTF-8 in a string field, ...
                return _Undecodable(exc)

        async def refuse(request, context) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

        async def checked(requests, context):
            async for request in requests:
                await refuse(request, context)
                yield request

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request, context):
                await refuse(request, context)
                return await behavior(request, context)

            return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
        if handler.stream_stream is not None:
            behavior = handler.stream_stream

            async def stream_stream(requests, context):
                async for response in behavior(checked(requests, context), context):
                    yield response

            return handler._replace(request_deserializer=deserialize,
                                    stream_stream=stream_stream)
        return handler  # specdec has no unary-stream or stream-unary methods


def make_server(max_message_bytes: int) -> grpc.aio.Server:
    return grpc.aio.server(options=server_options(max_message_bytes),
                           interceptors=[DecodeGuard()])


def bind(server: grpc.aio.Server, host: str, port: int, config=None) -> int:
    """Bind host:port (0 = any free port), with TLS when the config has a certificate."""
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if config is not None and getattr(config, "tls_cert", None):
        creds = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"could not bind {address}")
    return bound


async def run_call(context: grpc.aio.ServicerContext, future, work):
    """Submit core work, await its result, and turn core errors into gRPC status codes.

    ValueError -> INVALID_ARGUMENT, SessionNotFound -> NOT_FOUND, PrefixMismatch ->
    FAILED_PRECONDITION (the orchestrator re-prefills on the last two). A client that cancels
    the RPC cancels the work, which the model thread then drops at its next pass.
    """
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if work is not None:
            work.cancelled = True
        future.cancel()
        raise
    except SessionNotFound as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except PrefixMismatch as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


async def in_passing_thread(fn: Callable, *args):
    """``await fn(*args)`` run in a new thread that ends when fn returns.

    Loading a model runs torch's parallel (OpenMP) kernels. libgomp keeps a pool of helper
    threads for every thread that ever ran a parallel region, and once the process holds more
    of them than there are cores it makes every pool's helpers sleep between regions instead of
    spinning: each parallel op then pays futex wake-ups, and a 1-token forward on the model
    thread went from 30 ms to 45 ms. A pool lives as long as its thread, so the loader must not
    be a long-lived executor thread: the model thread must be the only lasting torch thread.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result=None, exc: BaseException | None = None) -> None:
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name="specdec-load", daemon=True).start()
    return await done


# What a service refuses to start with, said in one line (no traceback): a model specdec cannot
# run exactly (ValueError, from ArchConfig.from_hf), a missing model or file (OSError).
LOAD_REFUSALS = (ValueError, OSError)
LOAD_ERROR_PREFIX = "error: "


class ServiceHost:
    """Runs one model service: binds first, loads the model in the background, then SERVING.

    Health answers NOT_SERVING while the model loads (so Kubernetes readiness waits) and calls
    get UNAVAILABLE until it is ready.
    """

    def __init__(self, config, build_runtime: Callable, full_service_name: str):
        self.config = config
        self.build_runtime = build_runtime
        self.full_service_name = full_service_name
        self.runtime = None
        self.server = make_server(config.max_message_bytes)
        self.health = HealthReporter(self.server, [full_service_name])
        enable_reflection(self.server, [full_service_name])
        self.port = 0
        self._load_error: BaseException | None = None

    async def runtime_or_abort(self, context: grpc.aio.ServicerContext):
        if self.runtime is None:
            detail = f"model failed to load: {self._load_error}" if self._load_error else (
                "the model is still loading")
            await context.abort(grpc.StatusCode.UNAVAILABLE, detail)
        return self.runtime

    async def start(self, port_file: str | None = None) -> int:
        self.port = bind(self.server, self.config.host, self.config.port, self.config)
        await self.health.set(False)
        await self.server.start()
        log.info("%s listening on %s:%d, loading %s", self.config.role, self.config.host,
                 self.port, self.config.model)
        try:
            self.runtime = await in_passing_thread(self.build_runtime, self.config)
        except BaseException as exc:
            self._load_error = exc
            if isinstance(exc, LOAD_REFUSALS):  # a model refused or missing: its reason suffices
                log.error("loading %s failed: %s", self.config.model, exc)
            else:
                log.exception("loading %s failed", self.config.model)
            raise
        await self.health.set(True)
        log.info("%s ready: %s (forward ms by tokens: %s)", self.config.role,
                 self.config.model, [round(x, 1) for x in self.runtime.info.forward_ms])
        if port_file:
            tmp = pathlib.Path(port_file + ".tmp")
            tmp.write_text(str(self.port))
            tmp.rename(port_file)
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.set(False)
        await self.server.stop(grace)
        if self.runtime is not None:
            self.runtime.stop()

    async def serve_forever(self, port_file: str | None = None) -> None:
        try:
            await self.start(port_file)
        except BaseException as exc:
            await self.server.stop(0)  # not left to the closed loop's garbage collection
            if isinstance(exc, LOAD_REFUSALS):
                # One line, which orchestrator.local reports as the service's reason.
                what = (f"cannot load {self.config.model!r}" if exc is self._load_error
                        else "failed to start")  # e.g. its port is taken
                raise SystemExit(f"{LOAD_ERROR_PREFIX}{self.config.role} service {what}: "
                                 f"{exc}") from None
            raise
        try:
            await self.server.wait_for_termination()
        finally:
            await self.stop()


class CommonServicerMixin:
    """GetInfo, CloseSession and GetStats, the same on both services (``self.host``, ``pb``)."""

    host: "ServiceHost"
    pb = None  # the generated message module, set by the service

    async def GetInfo(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        return info_message(self.pb, rt.info)

    async def CloseSession(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        return self.pb.CloseResponse(released=rt.close_session(request.session_id))

    async def GetStats(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        return stats_message(self.pb, rt.stats())


def info_message(pb, info) -> object:
    return pb.ModelInfo(
        model=info.model, role=info.role, tokenizer_fingerprint=info.tokenizer_fingerprint,
        vocab_size=info.vocab_size, max_context=info.max_context,
        eos_token_ids=info.eos_token_ids, forward_ms=info.forward_ms, drafter=info.drafter,
    )


def stats_message(pb, stats: dict) -> object:
    return pb.ServiceStats(**stats)


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
    parser.add_argument("--cache-cap-mb", type=int, default=1024)
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--session-ttl-s", type=float, default=600.0)
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=0.0,
                        help="starting from idle, wait this long for other calls to join the "
                             "first pass (default 0: later calls join the next pass anyway)")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--kernels", choices=("auto", "onednn", "mkl"), default="auto",
                        help="CPU linear kernels: auto times oneMKL and prepacked oneDNN at start "
                             "and keeps the faster for 1 token and for blocks (default)")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-client-ca", help="require client certificates (mutual TLS)")
    parser.add_argument("--log-level", default="INFO")


def service_config_from_args(args, role: str):
    from specdec.config import ServiceConfig

    try:
        return ServiceConfig(
            model=args.model, role=role, host=args.host, port=args.port, device=args.device,
            threads=args.threads, cache_cap_mb=args.cache_cap_mb, max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s, max_message_bytes=args.max_message_bytes,
            max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
            prefill_chunk=args.prefill_chunk, kernels=args.kernels,
            calibrate=not args.no_calibrate, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
