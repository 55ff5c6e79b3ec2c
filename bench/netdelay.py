"""A delaying TCP proxy on loopback: a network round trip between the orchestrator and a service
on one machine (this kernel has no netem). Every chunk is delivered ``rtt_ms / 2`` after it
arrived, in order, in each direction, so a request/response pays one round trip more."""

from __future__ import annotations

import asyncio
import collections
import threading
import time


class DelayProxy:
    """``127.0.0.1:port`` forwards to ``upstream`` (HOST:PORT) with a delay each way; runs in a
    thread of its own (its own event loop) until ``close()``."""

    def __init__(self, upstream: str, rtt_ms: float):
        self.host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.delay_s = rtt_ms / 2000.0
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="delay-proxy", daemon=True)
        self._thread.start()
        self._started.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._started.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader, writer) -> None:
        """Copy reader to writer, each chunk ``delay_s`` after it was read."""
        pending: collections.deque = collections.deque()
        arrived = asyncio.Event()
        done = False

        async def deliver() -> None:
            while True:
                while not pending:
                    if done:
                        return
                    arrived.clear()
                    await arrived.wait()
                due, data = pending.popleft()
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                pending.append((time.perf_counter() + self.delay_s, data))
                arrived.set()
        finally:
            done = True
            arrived.set()
            try:
                await sender
            finally:
                writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
