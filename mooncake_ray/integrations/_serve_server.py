"""The LLM deployments of the apps: Ray Serve LLM's ``LLMServer`` (and the decode server of a
prefill/decode app), a stream's first token sent as soon as the engine makes it.

``LLMServer`` sends a stream's tokens in batches, one every ``stream_batching_interval_ms``
(``experimental_configs``; 50 ms by default) counted from the request's start, the first
batch too. A first token the engine makes 60 ms into the request leaves at 100 ms: the time
to first token a client sees is the engine's rounded up to the interval (in
``bench_kv_routing.py``'s workload, 24 ms of a mean TTFT of 150 ms; ``docs/performance.md``,
"The first token off Serve's clock"). Here the first batch leaves when the first output
does, and the rest on Ray's clock as before: one message more per stream. An interval of 0
(a message per output) or none (one message at the end) is Ray's own behaviour.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Iterable, List, TypeVar

from ray.llm._internal.serve.utils.batcher import Batcher
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer as _RayPDDecodeServer
from ray.serve.llm import LLMServer as _RayLLMServer

T = TypeVar("T")


class FirstOutBatcher(Batcher):
    """Ray's ``Batcher``, its first batch yielded as soon as the generator gives an output."""

    def __init__(self, generator: AsyncGenerator[T, None], interval_ms: float | None):
        self._first = asyncio.Event()
        super().__init__(generator, interval_ms)

    async def read(self):
        try:
            async for x in self.generator:
                self.queue.put_nowait(x)
                self._first.set()
        finally:
            self.done_event.set()
            self._first.set()

    async def stream(self) -> AsyncGenerator[Iterable[T], None]:
        rest = super().stream()
        if not self.interval_s:  # 0 or None: nothing waits on a clock
            async for out in rest:
                yield out
            return
        try:
            await self._first.wait()
            first: List[T] = self.drain_queue()
            if first:
                yield self._merge_results(first)
            async for out in rest:  # the rest on the clock, then the generator's end or error
                yield out
        finally:
            await rest.aclose()  # closes the reading task, if the stream ended early
            if not self.read_task.done():
                self.read_task.cancel()


class _FirstOut:
    """A Ray Serve LLM server's streams through :class:`FirstOutBatcher`."""

    def _batch_output_stream(self, generator: AsyncGenerator[T, None]) -> AsyncGenerator[List[T], None]:
        return FirstOutBatcher(generator, interval_ms=self._get_batch_interval_ms()).stream()


class LLMServer(_FirstOut, _RayLLMServer):
    """Ray's, under Ray's name (the deployment stays ``LLMServer:<model id>``)."""


class PDDecodeServer(_FirstOut, _RayPDDecodeServer):
    """Ray's decode server of a prefill/decode app (it runs the prefill remotely, then
    streams the decode), under Ray's name."""
