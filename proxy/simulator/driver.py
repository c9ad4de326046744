"""Runs the engine against the wall clock: one asyncio task steps it and hands out the outputs."""

from __future__ import annotations

import asyncio
import contextlib
import time

from proxy.simulator.engine import EngineCore, Output, Preempted, Rejected, Scheduled, SequenceSpec

# When the loop falls this far behind its timeline (a busy machine), it starts a new timeline
# instead of sending the missed tokens in a burst.
MAX_LAG_S = 0.05
IDLE_POLL_S = 0.01  # only when sequences wait but nothing can run (should not happen)


class SequenceStream:
    """What one request receives from the engine, in order: Scheduled, Output..., the last
    Output carrying `finish`."""

    __slots__ = ("arrived_at", "queue", "seq_id")

    def __init__(self, seq_id: int, arrived_at: float) -> None:
        self.seq_id = seq_id
        self.arrived_at = arrived_at
        self.queue: asyncio.Queue[Scheduled | Output | Preempted] = asyncio.Queue()


class EngineDriver:
    """Owns the engine loop task; requests submit a spec and read their SequenceStream."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._streams: dict[int, SequenceStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, spec: SequenceSpec) -> SequenceStream | Rejected:
        now = time.monotonic()
        result = self.core.submit(spec, now)
        if isinstance(result, Rejected):
            return result
        stream = SequenceStream(result, now)
        self._streams[result] = stream
        self._wake.set()
        return stream

    def abort(self, stream: SequenceStream) -> None:
        """Forget a sequence whose client has gone (or whose answer was cut by a fault)."""
        if self._streams.pop(stream.seq_id, None) is not None:
            self.core.abort(stream.seq_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        timeline = loop.time()
        while True:
            if self.core.idle:
                self._wake.clear()
                await self._wake.wait()
                timeline = loop.time()
            result = self.core.step(time.monotonic())
            self._dispatch(result.events, outputs=False)  # Scheduled and Preempted happen now
            if result.duration_s > 0:
                now = loop.time()
                if now - timeline > MAX_LAG_S:
                    timeline = now
                timeline += result.duration_s
                await asyncio.sleep(max(0.0, timeline - loop.time()))
            elif not self.core.idle:
                await asyncio.sleep(IDLE_POLL_S)
            self._dispatch(result.events, outputs=True)  # tokens exist once the step is done

    def _dispatch(self, events: tuple[Scheduled | Output | Preempted, ...], outputs: bool) -> None:
        for event in events:
            if isinstance(event, Output) != outputs:
                continue
            stream = self._streams.get(event.seq_id)
            if stream is None:
                continue
            stream.queue.put_nowait(event)
            if isinstance(event, Output) and event.finish is not None:
                del self._streams[event.seq_id]
