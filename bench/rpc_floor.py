"""The floor under a round's overhead: what a bare gRPC call costs here, model-free.

A server in a child process answers specdec's own messages (``TargetService``, over a
bidirectional stream and unary) after waiting ``wait_ms`` on a worker thread, as a model pass
would; the client reports the wall time of each call beyond that wait (median). Waiting is what
makes the difference: every thread on the call's path (the client's and the server's event
loops, gRPC's completion-queue pollers, the worker) has gone idle by the time the answer is
due, and waking that chain costs more than a back-to-back call. What specdec adds on top of
this floor is its own: ``overhead_ms_per_round`` in ``specdec generate --json`` minus this.

    python -m bench.rpc_floor [--wait-ms 0,1,10,50] [--calls 60]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import statistics
import time

import grpc

from specdec.wire import specdec_pb2 as pb
from specdec.wire import specdec_pb2_grpc as pb_grpc


class _Echo(pb_grpc.TargetServiceServicer):
    """Answers a verify after ``request.top_logprobs`` ms on a worker thread (the model's)."""

    def __init__(self):
        self.worker = concurrent.futures.ThreadPoolExecutor(1)

    async def _answer(self, request) -> pb.VerifyResponse:
        wait_s = request.top_logprobs / 1000.0
        if wait_s:
            await asyncio.wrap_future(self.worker.submit(time.sleep, wait_s))
        return pb.VerifyResponse(next_token=1, compute_ms=wait_s * 1000.0)

    async def Verify(self, request, context):
        return await self._answer(request)

    async def VerifyStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._answer(request)


def _serve(port_queue) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_TargetServiceServicer_to_server(_Echo(), server)
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def measure(address: str, wait_ms: list[int], calls: int) -> list[dict]:
    """Median overhead (ms beyond the server's wait) per wait and call kind."""
    rows = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        for wait in wait_ms:
            row = {"wait_ms": wait}
            stream = stub.VerifyStream()
            for kind in ("stream", "unary"):
                over = []
                for i in range(calls + 5):
                    req = pb.VerifyRequest(tokens=[1], top_logprobs=wait)
                    start = time.perf_counter()
                    if kind == "stream":
                        await stream.write(req)
                        resp = await stream.read()
                    else:
                        resp = await stub.Verify(req)
                    if i >= 5:  # warm-up
                        over.append((time.perf_counter() - start) * 1000.0 - resp.compute_ms)
                row[f"{kind}_ms"] = round(statistics.median(over), 3)
            await stream.done_writing()
            rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wait-ms", default="0,1,10,50",
                   help="server-side waits to try, comma-separated (default: %(default)s)")
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args(argv)
    waits = [int(w) for w in args.wait_ms.split(",")]
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        rows = asyncio.run(measure(f"127.0.0.1:{ports.get(timeout=60)}", waits, args.calls))
    finally:
        server.terminate()
        server.join(10)
    print("wait ms | bidi stream overhead ms | unary overhead ms")
    for r in rows:
        print(f"{r['wait_ms']:>7} | {r['stream_ms']:>23} | {r['unary_ms']:>17}")
    return rows


if __name__ == "__main__":
    main()
