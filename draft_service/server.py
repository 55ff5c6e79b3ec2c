"""DraftService servicer: parse, call the core (specdec.serving.runtime.DraftRuntime), reply."""

from __future__ import annotations

import argparse
import functools
import logging

import grpc

from specdec.config import ServiceConfig
from specdec.models.loading import build_draft
from specdec.rpc import service_main
from specdec.rpc.host import CommonServicerMixin, ServiceHost, run_call
from specdec.serving.branching import BranchCall
from specdec.serving.drafting import ProposeCall
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(CommonServicerMixin, pb_grpc.DraftServiceServicer):
    pb = pb

    def __init__(self, host: ServiceHost):
        self.host = host

    async def _propose(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        if request.branches.width:
            return await self._branches(rt, request, context)
        try:
            call = ProposeCall.from_wire(request, rt.info.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        future, work = rt.propose(call)
        proposal = await run_call(context, future, work)
        return pb.DraftResponse(
            tokens=proposal.tokens,
            dists=[pb.SparseDist(ids=i, probs=p) for i, p in proposal.dists],
            cache_len=proposal.cache_len,
            compute_ms=(work.compute_s * 1000.0) if work is not None else 0.0,
        )

    async def _branches(self, rt, request, context):
        try:
            call = BranchCall.from_wire(request, rt.info.vocab_size)
            future, work = rt.propose_branches(call)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        proposal = await run_call(context, future, work)
        return pb.DraftResponse(
            branches=[pb.BranchBlock(accepted=b.accepted, token=b.token, tokens=b.tokens)
                      for b in proposal.branches],
            cache_len=proposal.cache_len, compute_ms=work.compute_s * 1000.0)

    async def Propose(self, request, context):
        return await self._propose(request, context)

    async def ProposeStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._propose(request, context)


def make_host(config: ServiceConfig, target: str = "default", q_top_k: int = 64) -> ServiceHost:
    build = functools.partial(build_draft, target=target, q_top_k=q_top_k)
    host = ServiceHost(config, build, SERVICE_NAME)
    pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(host), host.server)
    return host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    service_main.add_service_arguments(parser, default_model="default-draft")
    parser.add_argument("--target", default="default",
                        help="the target this draft serves (its tokenizer; default: %(default)s)")
    parser.add_argument("--q-top-k", type=int, default=64,
                        help="sampling: the draft samples from (and sends) its top-N tokens")


def run(args) -> None:
    service_main.serve(args, make_host, role="draft", target=args.target, q_top_k=args.q_top_k)


def main(argv=None) -> None:
    service_main.main(argv, "specdec serve-draft", __doc__, add_arguments, run)


if __name__ == "__main__":
    main()
