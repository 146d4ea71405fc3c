"""EventStreamResponse on its own (runtime/entrypoints/sse.py): the ASGI `send`/`receive` are test doubles,
so each case controls exactly which write stalls and for how long.

The idle timeout bounds a write (a consumer that stopped reading), not the wait for the next
event (an engine that is slow to produce one): the watchdog looks only at a write in progress.
"""

from __future__ import annotations

import asyncio

from tokenlane.runtime.entrypoints.sse import EventStreamResponse

TIMEOUT_S = 0.05


class Receiver:
    """`receive` of a client that stays connected until `disconnect()`."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()

    async def __call__(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def disconnect(self) -> None:
        self._gone.set()


class Sender:
    """`send` that records the body chunks; the write of chunk `stall_at` never completes."""

    def __init__(self, stall_at: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.stall_at = stall_at

    async def __call__(self, message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if self.stall_at is not None and len(self.bodies) == self.stall_at:
            await asyncio.Event().wait()  # the transport stays paused: the reader is gone quiet
        self.bodies.append(message["body"])


async def events(count: int, gap_s: float = 0.0, produced: list | None = None):
    for i in range(count):
        if gap_s:
            await asyncio.sleep(gap_s)
        if produced is not None:
            produced.append(i)
        yield f"data: {i}\n\n"


async def serve(response: EventStreamResponse, receiver: Receiver, sender: Sender) -> None:
    await asyncio.wait_for(response({"type": "http"}, receiver, sender), timeout=30)


async def test_a_slow_producer_is_not_a_stalled_consumer():
    # Four gaps of four timeouts each between events: only writes are bounded.
    closed: list[str] = []
    response = EventStreamResponse(events(4, gap_s=4 * TIMEOUT_S), closed.append, TIMEOUT_S, {})
    sender = Sender()
    await serve(response, Receiver(), sender)
    assert closed == ["completed"]
    assert sender.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n", b""]


async def test_a_write_that_never_completes_ends_the_stream_as_stalled(caplog):
    closed: list[str] = []
    produced: list[int] = []
    response = EventStreamResponse(events(10, produced=produced), closed.append, TIMEOUT_S, {})
    sender = Sender(stall_at=2)
    await serve(response, Receiver(), sender)
    assert closed == ["stream_idle_timeout"]
    assert sender.bodies == [b"data: 0\n\n", b"data: 1\n\n"]
    assert produced == [0, 1, 2]  # nothing was pulled from the engine after the stall
    assert "stream consumer stalled" in caplog.text


async def test_a_client_that_disconnects_mid_stream_is_noticed_while_waiting_for_events():
    closed: list[str] = []
    receiver = Receiver()

    async def stream():
        yield "data: 0\n\n"
        receiver.disconnect()
        await asyncio.Event().wait()  # the engine has nothing more yet
        yield "data: never\n\n"

    sender = Sender()
    await serve(EventStreamResponse(stream(), closed.append, TIMEOUT_S, {}), receiver, sender)
    assert closed == ["client_disconnect"]
    assert sender.bodies == [b"data: 0\n\n"]
