"""TargetService servicer: parse, call the core (specdec.runtime.TargetRuntime), reply."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specdec import rpc
from specdec.config import ServiceConfig
from specdec.loading import build_target
from specdec.target import VerifyCall
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name


def _wire_logprobs(entries) -> list:
    return [pb.TokenLogprobs(logprob=lp, top_ids=ids, top_logprobs=lps) for lp, ids, lps in entries]


class TargetServicer(rpc.CommonServicerMixin, pb_grpc.TargetServiceServicer):
    pb = pb

    def __init__(self, host: rpc.ServiceHost):
        self.host = host

    async def _verify(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        try:
            call = VerifyCall.from_wire(request, rt.info.vocab_size)
        except ValueError as exc:
            await context.abort(rpc.grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        future, work = rt.verify(call)
        result = await rpc.run_call(context, future, work)
        return pb.VerifyResponse(
            num_accepted=result.num_accepted,
            next_token=result.next_token,
            cache_len=result.cache_len,
            compute_ms=work.compute_s * 1000.0,
            batch_size=work.batch_size,
            logprobs=_wire_logprobs(result.logprobs),
            prompt_logprobs=_wire_logprobs(result.prompt_logprobs),
        )

    async def Verify(self, request, context):
        return await self._verify(request, context)

    async def VerifyStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._verify(request, context)


def make_host(config: ServiceConfig) -> rpc.ServiceHost:
    host = rpc.ServiceHost(config, build_target, SERVICE_NAME)
    pb_grpc.add_TargetServiceServicer_to_server(TargetServicer(host), host.server)
    return host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rpc.add_service_arguments(parser, default_model="default")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="specdec serve-target", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    run(args)


def run(args) -> None:
    rpc.configure_logging(args.log_level)
    config = rpc.service_config_from_args(args, role="target")
    asyncio.run(_serve(config, args.port_file))


async def _serve(config: ServiceConfig, port_file: str | None) -> None:
    # The aio server must be made inside the running event loop.
    await make_host(config).serve_forever(port_file)


if __name__ == "__main__":
    main()
