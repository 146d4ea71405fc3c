"""Server-sent events, and noticing a client that went away.

A client that disconnects, streaming or not, is noticed at once (not at the next write), and
so is a streaming consumer that stops reading for `scheduler.streamIdleTimeoutMs`: the
caller then cancels the request in the engine (runtime/entrypoints/completions.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from json.encoder import encode_basestring_ascii
from typing import Any, AsyncIterator, Callable, Optional

import anyio
from fastapi.responses import Response

log = logging.getLogger("tokenlane.server")


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder, not one per event


def sse_event(payload: Any) -> str:
    """One `data: {...}` event (compact JSON)."""
    return f"data: {_COMPACT_JSON.encode(payload)}\n\n"


class TextEventTemplate:
    """The event of one payload whose only varying part is one string field, encoded once
    around that field: a streamed token's chunk is then the fixed head, the token's text as a
    JSON string, and the fixed tail. Exactly `sse_event` of the payload with the text in it,
    at 0.2 instead of 4-5 us per token (building and encoding every chunk whole took about a
    sixth of the event loop's busy time behind 64 streams).

    `payload` has `TEXT_SLOT` where the text goes. `of` gives None where the payload cannot
    be split at the slot (another field's whole value is the slot too): use `sse_event`.
    """

    TEXT_SLOT = "\x00"  # a NUL: it never stands for itself in an OpenAI chunk's fixed fields
    _ENCODED_SLOT = json.dumps(TEXT_SLOT)

    def __init__(self, head: str, tail: str) -> None:
        self.head, self.tail = head, tail

    @classmethod
    def of(cls, payload: Any) -> Optional["TextEventTemplate"]:
        parts = sse_event(payload).split(cls._ENCODED_SLOT)
        return cls(parts[0], parts[1]) if len(parts) == 2 else None

    def __call__(self, text: str) -> str:
        return self.head + encode_basestring_ascii(text) + self.tail


DONE_EVENT = "data: [DONE]\n\n"


async def wait_disconnect(receive: Callable) -> None:
    """Returns when the client has gone (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the awaited work was done."""


async def until_disconnect(awaitable, receive: Callable):
    """Await `awaitable`, or raise ClientGone as soon as the client disconnects."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
            # A gather cancelled here may still end with an exception: retrieve it, so asyncio
            # does not log "exception was never retrieved".
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


# The scope key under which the app (runtime/entrypoints/app.py) keeps the server's own `send`,
# before any middleware wraps it. Starlette's and FastAPI's wrappers only note that a response
# has started, so a stream's body chunks skip them: three coroutine calls per token and stream.
RAW_SEND = "tokenlane.raw_send"


class DirectChunks:
    """A stream's chunks written as the event loop dispatches a step's outputs, without waking
    the response's task for each one (a wake-up, four frames resumed and suspended again, per
    token and stream: most of the event loop's work behind many streams).

    The response sets `write` once its start is out; the events generator sets its request
    stream's `direct` hook (RequestStream, runtime/engine/async_engine.py), which the stream
    calls only while its consumer waits with nothing queued, so nothing is in flight and the
    order holds. A chunk the transport cannot take at once (flow control) finishes in a task of
    its own; until it has, chunks queue for the response's task, which waits for it first.
    """

    def __init__(self) -> None:
        self.write: Optional[Callable[[str], bool]] = None  # True: written (or being written)


class EventStreamResponse(Response):
    """An SSE response that watches the client while it streams.

    Unlike a plain StreamingResponse it (1) listens for `http.disconnect` concurrently, so a
    client that goes away while the engine is still computing is noticed at once, not at the
    next write, and (2) bounds every write by the stream idle timeout: a consumer that stops
    reading blocks the transport's flow control, and after the timeout the request is
    cancelled and the connection closed. `on_close` runs exactly once in every case. With
    `direct`, the events generator may have chunks written for it (DirectChunks).
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[str], None],
        idle_timeout_s: float,
        headers: dict[str, str],
        direct: Optional[DirectChunks] = None,
    ) -> None:
        # As StreamingResponse does: no body attribute, so no Content-Length header.
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", **headers})
        self.events = events
        self.on_close = on_close
        self.idle_timeout_s = idle_timeout_s
        self.direct = direct
        # When the write in progress began (None between writes). A watchdog checks it four
        # times per timeout instead of a timer armed and disarmed around every write: one
        # write per token made that timer (anyio.fail_after) a third of the event loop's work
        # for a stream. A stalled write is cancelled between 1 and 1.25 timeouts in.
        self._writing_since: Optional[float] = None
        self._body_send: Optional[Callable] = None
        self._pending: Optional[asyncio.Future] = None  # a direct chunk the transport had to wait for

    def _write_now(self, event: str) -> bool:
        """Write one chunk from the dispatch (DirectChunks); False: queue it instead."""
        if self._pending is not None:
            return False
        write = self._body_send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        try:
            waiting_on = write.send(None)
        except StopIteration:  # written
            return True
        except Exception:
            return False  # the response's task meets the same error on its own write
        self._writing_since = asyncio.get_running_loop().time()
        self._pending = asyncio.ensure_future(self._finish_write(write, waiting_on))
        self._pending.add_done_callback(_retrieve)
        return True

    async def _finish_write(self, write, waiting_on) -> None:
        """Drive a send that suspended (as a task would: resume it once what it awaits is done)."""
        try:
            while True:
                if waiting_on is None:  # a bare yield: another turn of the loop
                    await asyncio.sleep(0)
                else:
                    await asyncio.wait([waiting_on])  # its outcome is the send's to read
                waiting_on = write.send(None)
        except StopIteration:
            pass
        except asyncio.CancelledError:
            write.close()
            raise
        finally:
            self._writing_since = None

    async def __call__(self, scope, receive, send) -> None:
        how = "client_disconnect"
        loop = asyncio.get_running_loop()
        stalled = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()

            async def watchdog() -> None:
                nonlocal stalled
                while True:
                    await asyncio.sleep(self.idle_timeout_s / 4)
                    since = self._writing_since
                    if since is not None and loop.time() - since >= self.idle_timeout_s:
                        stalled = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            tg.start_soon(watchdog)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                # The start (and the end) through the middlewares, the chunks past them.
                body_send = self._body_send = scope.get(RAW_SEND, send)
                if self.direct is not None:
                    self.direct.write = self._write_now
                async for event in self.events:
                    if self._pending is not None:
                        await self._pending_written()
                    self._writing_since = loop.time()
                    await body_send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                    self._writing_since = None
                if self._pending is not None:
                    await self._pending_written()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                how = "completed"
            except OSError:
                how = "client_disconnect"
            finally:
                if self.direct is not None:
                    self.direct.write = None
                if self._pending is not None:
                    self._pending.cancel()
                if stalled:
                    how = "stream_idle_timeout"
                    log.warning("stream consumer stalled for %.1fs; cancelling the request", self.idle_timeout_s)
                self.on_close(how)
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.events.aclose()

    async def _pending_written(self) -> None:
        """The direct chunk the transport made wait is out (`_write_now` starts no other meanwhile)."""
        await self._pending
        self._pending = None
