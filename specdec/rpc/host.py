"""A model service's gRPC host: binds, loads the model in the background, then serves.

The standard health service and reflection, the guard that answers INVALID_ARGUMENT to bytes
that are not a protobuf message, the mapping from core errors to gRPC status codes, and the
servicer methods both services share.
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

from specdec.rpc.transport import bind, server_options
from specdec.serving.session import PrefixMismatch, SessionNotFound

log = logging.getLogger(__name__)


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


async def run_call(context: grpc.aio.ServicerContext, future, work):
    """Submit core work, await its result, and turn core errors into gRPC status codes.

    ValueError -> INVALID_ARGUMENT, SessionNotFound -> NOT_FOUND, PrefixMismatch ->
    FAILED_PRECONDITION (the orchestrator re-prefills on the last two), MemoryError (a call
    whose pass does not fit in memory even alone) -> RESOURCE_EXHAUSTED. A client that
    cancels the RPC cancels the work, which the model thread then drops at its next pass.
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
    except MemoryError as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


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
        numerics=info.numerics, features=info.features, feature_dim=info.feature_dim,
        feature_layers=info.feature_layers,
    )


def stats_message(pb, stats: dict) -> object:
    return pb.ServiceStats(**stats)


