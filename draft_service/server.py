"""DraftService servicer: parse, call the core (specdec.runtime.DraftRuntime), reply."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging

from specdec import rpc
from specdec.config import ServiceConfig
from specdec.drafting import ProposeCall
from specdec.loading import build_draft
from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(rpc.CommonServicerMixin, pb_grpc.DraftServiceServicer):
    pb = pb

    def __init__(self, host: rpc.ServiceHost):
        self.host = host

    async def _propose(self, request, context):
        rt = await self.host.runtime_or_abort(context)
        try:
            call = ProposeCall.from_wire(request, rt.info.vocab_size)
        except ValueError as exc:
            await context.abort(rpc.grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        future, work = rt.propose(call)
        proposal = await rpc.run_call(context, future, work)
        return pb.DraftResponse(
            tokens=proposal.tokens,
            dists=[pb.SparseDist(ids=i, probs=p) for i, p in proposal.dists],
            cache_len=proposal.cache_len,
            compute_ms=(work.compute_s * 1000.0) if work is not None else 0.0,
        )

    async def Propose(self, request, context):
        return await self._propose(request, context)


def make_host(config: ServiceConfig, target: str = "default", q_top_k: int = 64) -> rpc.ServiceHost:
    build = functools.partial(build_draft, target=target, q_top_k=q_top_k)
    host = rpc.ServiceHost(config, build, SERVICE_NAME)
    pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(host), host.server)
    return host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rpc.add_service_arguments(parser, default_model="default-draft")
    parser.add_argument("--target", default="default",
                        help="the target this draft serves (its tokenizer; default: %(default)s)")
    parser.add_argument("--q-top-k", type=int, default=64,
                        help="sampling: the draft samples from (and sends) its top-N tokens")


def run(args) -> None:
    rpc.configure_logging(args.log_level)
    config = rpc.service_config_from_args(args, role="draft")
    asyncio.run(_serve(config, args.target, args.q_top_k, args.port_file))


async def _serve(config: ServiceConfig, target: str, q_top_k: int, port_file: str | None) -> None:
    # The aio server must be made inside the running event loop.
    await make_host(config, target=target, q_top_k=q_top_k).serve_forever(port_file)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="specdec serve-draft", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
