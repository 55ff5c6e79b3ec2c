"""TargetService servicer: parse, call the core (specdec.serving.runtime.TargetRuntime), reply."""

from __future__ import annotations

import argparse
import logging

import grpc

from specdec.config import ServiceConfig
from specdec.models.loading import build_target
from specdec.rpc import service_main
from specdec.rpc.host import CommonServicerMixin, ServiceHost, run_call
from specdec.serving.target import VerifyCall
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TargetService"].full_name


def _wire_logprobs(entries) -> list:
    return [pb.TokenLogprobs(logprob=lp, top_ids=ids, top_logprobs=lps) for lp, ids, lps in entries]


def features_message(features) -> pb.Features | None:
    """VerifyResult.features (start, [rows, hidden] float16) as the wire's Features."""
    if features is None:
        return None
    start, rows = features
    return pb.Features(start=start, dim=rows.shape[1], data=rows.numpy().astype("<f2").tobytes())


class TargetServicer(CommonServicerMixin, pb_grpc.TargetServiceServicer):
    pb = pb

    def __init__(self, host: ServiceHost):
        self.host = host

    async def _verify(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        try:
            call = VerifyCall.from_wire(request, rt.info.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        future, work = rt.verify(call)
        result = await run_call(context, future, work)
        return pb.VerifyResponse(
            num_accepted=result.num_accepted,
            next_token=result.next_token,
            cache_len=result.cache_len,
            compute_ms=work.compute_s * 1000.0,
            batch_size=work.batch_size,
            pass_tokens=work.pass_tokens,
            queued_ms=work.queued_s * 1000.0,
            logprobs=_wire_logprobs(result.logprobs),
            prompt_logprobs=_wire_logprobs(result.prompt_logprobs),
            decoded=result.decoded,
            passes=result.passes,
            features=features_message(result.features),
        )

    async def Verify(self, request, context):
        return await self._verify(request, context)

    async def VerifyStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._verify(request, context)


def make_host(config: ServiceConfig) -> ServiceHost:
    host = ServiceHost(config, build_target, SERVICE_NAME)
    pb_grpc.add_TargetServiceServicer_to_server(TargetServicer(host), host.server)
    return host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    service_main.add_service_arguments(parser, default_model="default")


def run(args) -> None:
    service_main.serve(args, make_host, role="target")


def main(argv=None) -> None:
    service_main.main(argv, "specdec serve-target", __doc__, add_arguments, run)


if __name__ == "__main__":
    main()
