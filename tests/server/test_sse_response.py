"""EventStreamResponse on its own (runtime/entrypoints/sse.py): the ASGI `send`/`receive` are test doubles,
so each case controls exactly which write stalls and for how long.

The idle timeout bounds a write (a consumer that stopped reading), not the wait for the next
event (an engine that is slow to produce one): the watchdog looks only at a write in progress.
"""

from __future__ import annotations

import asyncio

from tokenlane.runtime.core.request import Request, SamplingParams
from tokenlane.runtime.engine.async_engine import RequestStream
from tokenlane.runtime.engine.output import RequestOutput
from tokenlane.runtime.entrypoints.sse import RAW_SEND, DirectChunks, EventStreamResponse

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


async def test_body_chunks_take_the_servers_own_send_and_the_start_and_end_the_middlewares():
    # The app puts the server's `send` in the scope (runtime/entrypoints/app.py); the
    # middlewares' wrapped one sees the response start and end, the chunks go past it.
    raw, wrapped = [], []

    async def server_send(message: dict) -> None:
        raw.append(message)

    async def middleware_send(message: dict) -> None:
        wrapped.append(message)
        await server_send(message)

    closed: list[str] = []
    response = EventStreamResponse(events(3), closed.append, TIMEOUT_S, {})
    scope = {"type": "http", RAW_SEND: server_send}
    await asyncio.wait_for(response(scope, Receiver(), middleware_send), timeout=30)
    assert closed == ["completed"]
    assert [m["type"] for m in wrapped] == ["http.response.start", "http.response.body"]
    assert wrapped[-1]["more_body"] is False
    assert [m.get("body") for m in raw] == [None, b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]


# Chunks written from the dispatch (DirectChunks): a request stream whose consumer waits hands
# a non-final output to the hook instead of waking it, as runtime/entrypoints/completions.py
# sets it up for a plain stream.


class _Owner:
    def abort(self, request_id: str, reason: str) -> None:
        pass


def _output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", lane="default", new_token_ids=[i], new_text=str(i), finished=finished,
                         finish_reason=None, finish_detail="", num_prompt_tokens=1, num_output_tokens=i + 1,
                         num_cached_tokens=0)


def _direct_stream():
    """A request stream, the response's DirectChunks, and the events its generator makes
    (each event the generator itself yielded is also noted in `pulled`)."""
    stream = RequestStream(Request("r", [1], SamplingParams()), _Owner())
    direct = DirectChunks()
    pulled: list[str] = []

    async def events():
        async for out in stream:
            if out.finished:
                return
            pulled.append(out.new_text)
            yield f"data: {out.new_text}\n\n"

    stream.direct = lambda out: direct.write is not None and direct.write(f"data: {out.new_text}\n\n")
    return stream, direct, events(), pulled


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_direct_chunks_keep_their_order_when_the_transport_makes_one_wait():
    stream, direct, events, pulled = _direct_stream()
    released = asyncio.Event()
    bodies: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if message["body"] == b"data: 2\n\n":
            await released.wait()  # flow control: the transport is paused for this chunk
        bodies.append(message["body"])

    closed: list[str] = []
    response = EventStreamResponse(events, closed.append, 30.0, {}, direct)
    task = asyncio.ensure_future(response({"type": "http"}, Receiver(), send))
    await _settle()
    for i in range(6):
        stream._put(_output(i))
        await _settle()
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n"]  # 2 waits for the transport, 3 to 5 behind it
    released.set()
    stream._put(_output(6, finished=True))
    await asyncio.wait_for(task, timeout=30)
    assert closed == ["completed"]
    assert bodies == [f"data: {i}\n\n".encode() for i in range(6)] + [b""]
    assert pulled == ["3", "4", "5"]  # 0 to 2 went out from the dispatch, the rest queued


async def test_a_direct_chunk_that_never_completes_ends_the_stream_as_stalled():
    stream, direct, events, _ = _direct_stream()
    closed: list[str] = []
    response = EventStreamResponse(events, closed.append, TIMEOUT_S, {}, direct)
    task = asyncio.ensure_future(response({"type": "http"}, Receiver(), Sender(stall_at=1)))
    await _settle()
    for i in range(3):
        stream._put(_output(i))
        await _settle()
    await asyncio.wait_for(task, timeout=30)
    assert closed == ["stream_idle_timeout"]
    assert direct.write is None  # the stream's outputs queue again (nobody reads them)
