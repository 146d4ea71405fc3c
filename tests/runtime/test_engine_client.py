"""The engine boundary: EngineClient's two implementations and the typed, versioned messages
between the API process and its engine core. The core-process client is driven here
against an EngineCore run by threads of this process over real pipes (the spawned process
itself is tested behind HTTP in tests/server/test_engine_core.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import struct
import threading

import pytest

from tokenlane.runtime.core.admission import AdmissionError
from tokenlane.runtime.core.request import FinishReason, Request, RequestStatus, SamplingParams, SequenceGroup
from tokenlane.runtime.engine import messages as wire
from tokenlane.runtime.engine.async_engine import AsyncEngine
from tokenlane.runtime.engine.client import EngineClient, InProcessClient
from tokenlane.runtime.engine.core_client import CoreProcessClient, CoreView
from tokenlane.runtime.engine.core_process import EngineCore, dumps_for_core
from tokenlane.runtime.engine.llm_engine import LLMEngine
from tokenlane.runtime.engine.output import RequestOutput
from tokenlane.runtime.executor.fake import FakeExecutor, StepGate, make_config


def make_engine(num_blocks=64, token_fn=None, **engine_kw):
    config = make_config(max_model_len=512)
    executor = FakeExecutor(num_blocks, config.engine.block_size, max_model_len=None, token_fn=token_fn)
    return LLMEngine(config, executor, **engine_kw), executor


def req(rid, n=6, max_tokens=4, **sampling):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **sampling))


class CharTokenizer:
    """Token i decodes to chr(i) (ASCII)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


def text_tokens(text):
    """A FakeExecutor token_fn that says `text` after a 6-token prompt, then "~" for ever."""
    return lambda rid, pos: ord(text[pos - 6]) if pos - 6 < len(text) else ord("~")


class Finished:
    """An observer that keeps the finished requests."""

    def __init__(self) -> None:
        self.requests = []

    def on_step(self, stats) -> None:
        pass

    def on_request_finished(self, request) -> None:
        self.requests.append(request)

    def on_config_applied(self, config, ok, message) -> None:
        pass


async def collect(stream):
    return [out async for out in stream]


def of_another_version(data: bytes) -> bytes:
    return data[:4] + struct.pack("<H", wire.WIRE_VERSION + 1) + data[6:]


# --------------------------------------------------------------------------- messages


def test_every_message_survives_the_wire():
    engine, _ = make_engine()
    output = RequestOutput("r", "default", [5, 6], "hi", True, FinishReason.LENGTH, "max_tokens", 3, 2, 0)
    messages = [
        wire.AddRequests((wire.AddRequest(0, False, b"x"), wire.AddRequest(1, True, b"y"))),
        wire.Abort("r", "client_disconnect"),
        wire.Reload(engine.config),
        wire.Stop(),
        wire.Ready(1000, False, 512, engine.snapshot()),
        wire.LoadFailed("no such model"),
        wire.Replies((wire.Admitted(0, ("default",)), wire.Refused(1, 429, "queue_full", "full", 1.5))),
        wire.StepOutputs([output], (wire.ConfigApplied(engine.config, True, "applied", 512),), engine.snapshot()),
        wire.CoreDied("RuntimeError: device lost"),
        wire.Stopped(),
    ]
    for message in messages:
        assert wire.decode(wire.encode(message)) == message


def test_a_message_of_another_wire_version_is_refused_with_both_versions():
    data = of_another_version(wire.encode(wire.Stop()))
    with pytest.raises(wire.WireVersionError) as refused:
        wire.decode(data)
    assert isinstance(refused.value, ValueError)
    message = str(refused.value)
    assert f"wire version {wire.WIRE_VERSION + 1}" in message and f"speaks version {wire.WIRE_VERSION}" in message
    # Nothing of ours: the old positional tuples, or a truncated frame.
    for data in (pickle.dumps(("stop",)), b"TL"):
        with pytest.raises(wire.WireVersionError, match="not an engine core message"):
            wire.decode(data)


def test_a_refusal_carries_the_admission_error_across():
    error = AdmissionError(429, "queue_full", "the lane's queue is full", retry_after_s=2.0)
    refused = wire.decode(wire.encode(wire.Refused.of(7, error)))
    again = refused.error()
    assert refused.call == 7
    assert (again.status, again.reason, again.message, again.retry_after_s) == (429, "queue_full",
                                                                               "the lane's queue is full", 2.0)


# --------------------------------------------------------------------------- the core's side


def test_the_core_answers_typed_commands_and_skips_one_of_another_version():
    engine, _ = make_engine()
    commands, to_core = multiprocessing.Pipe(duplex=False)
    from_core, events = multiprocessing.Pipe(duplex=False)
    core = EngineCore(engine, events)
    reader = threading.Thread(target=core.serve_commands, args=(commands,))
    reader.start()
    to_core.send_bytes(of_another_version(wire.encode(wire.Stop())))  # logged and skipped
    to_core.send_bytes(wire.encode(wire.AddRequests((
        wire.AddRequest(0, False, dumps_for_core(req("a", max_tokens=50))),
        wire.AddRequest(1, False, dumps_for_core(req("long", n=600))),
    ))))
    to_core.send_bytes(wire.encode(wire.Abort("a", "client_disconnect")))
    to_core.close()
    reader.join(30)
    assert not reader.is_alive()
    core.close()
    sent = []
    while from_core.poll():
        sent.append(wire.decode(from_core.recv_bytes()))
    (replies,) = [m for m in sent if isinstance(m, wire.Replies)]
    admitted, refused = replies.replies
    assert admitted == wire.Admitted(0, (engine.config.default_lane.name,))
    assert isinstance(refused, wire.Refused) and (refused.call, refused.status, refused.reason) == (1, 400, "too_long")
    finished = [e.request.request_id for m in sent if isinstance(m, wire.StepOutputs) for e in m.events
                if isinstance(e, wire.RequestFinished)]
    assert finished == ["long"]  # the refusal's metrics, relayed without waiting for a step
    assert not core._stopping  # the Stop of another version was not obeyed
    (out,) = engine.step()  # the abort is staged: "a" ends at the next step boundary
    assert (out.request_id, out.finish_reason, out.finish_detail) == ("a", FinishReason.CANCELLED, "client_disconnect")
    assert engine.scheduler.kv.num_free_blocks == 64


# --------------------------------------------------------------------------- the clients


class ThreadCore:
    """An EngineCore whose command thread and step loop are threads of this process, and a
    stand-in for its process, for a CoreProcessClient to talk to over real pipes."""

    def __init__(self, engine: LLMEngine) -> None:
        commands, self.to_core = multiprocessing.Pipe(duplex=False)
        self.from_core, events = multiprocessing.Pipe(duplex=False)
        self.core = EngineCore(engine, events)
        self.exitcode = None
        self._threads = [threading.Thread(target=self.core.serve_commands, args=(commands,), daemon=True),
                         threading.Thread(target=self._run, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        self.core.run()
        self.core.close()
        self.exitcode = 0

    # The multiprocessing.Process interface CoreProcessClient uses. The "process" lives as
    # long as its step loop; the command thread ends when the client closes its pipe.
    def is_alive(self) -> bool:
        return self._threads[1].is_alive()

    def join(self, timeout=None) -> None:
        self._threads[1].join(timeout)

    def kill(self) -> None:
        self.core._halt = True
        self.core._wakeup.set()


def core_client(engine: LLMEngine, tokenizer=None) -> tuple[CoreProcessClient, ThreadCore]:
    core = ThreadCore(engine)
    ready = wire.Ready(engine.vocab_size, engine.supports_logprobs, engine.max_model_len, engine.snapshot())
    client = CoreProcessClient(CoreView(engine.config, ready, tokenizer), core, core.to_core, core.from_core)
    return client, core


async def test_both_clients_are_engine_clients_and_serve_alike():
    for kind in ("in-process", "core-process"):
        engine, executor = make_engine()
        client = InProcessClient(AsyncEngine(engine)) if kind == "in-process" else core_client(engine)[0]
        assert isinstance(client, EngineClient), kind
        await client.start()
        assert client.ready and client.healthy and client.max_model_len == 512
        streams = [await client.submit(req(f"r{i}", max_tokens=2 + i)) for i in range(3)]
        members = [req("g0", max_tokens=3), req("g1", max_tokens=3)]
        SequenceGroup.of(members)
        group = await client.submit_group(members)
        with pytest.raises(AdmissionError) as refused:  # answered by the engine at once
            await client.submit(req("long", n=600))
        assert (refused.value.status, refused.value.reason) == (400, "too_long"), kind
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams + group)), 30)
        for outs, n in zip(results, [2, 3, 4, 3, 3]):
            assert sum(len(o.new_token_ids) for o in outs) == n, kind
            assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert streams[0].request.lane == engine.config.default_lane.name
        await client.shutdown(1.0)
        assert client.draining and not client.ready
        with pytest.raises(AdmissionError) as refused:
            await client.submit(req("late"))
        assert (refused.value.status, refused.value.reason) == (503, "draining"), kind
        assert engine.scheduler.kv.num_free_blocks == 64


async def test_an_abort_through_the_core_process_client_frees_the_blocks_in_the_core():
    engine, executor = make_engine(num_blocks=256)
    client, core = core_client(engine)
    await client.start()
    with StepGate(executor) as gate:
        # The step that would give "a" its second token waits until the abort is staged.
        gate.pause_when(lambda plan: any(c.request.request_id == "a" and c.request.num_output_tokens >= 1
                                         for c in plan.chunks))
        stream = await client.submit(req("a", max_tokens=400))
        await asyncio.to_thread(gate.wait_paused)
        stream.abort("client_disconnect")
        gate.resume()
        outs = await asyncio.wait_for(collect(stream), 30)
    assert outs[-1].finish_reason is FinishReason.CANCELLED and outs[-1].finish_detail == "client_disconnect"
    await client.shutdown(1.0)
    assert engine.scheduler.kv.num_free_blocks == 256


async def test_a_core_that_speaks_another_wire_version_fails_the_client_clearly():
    engine, _ = make_engine()
    client, core = core_client(engine)
    core.kill()  # the thread core stays quiet: the foreign message below is all the client hears
    core.join(30)
    await client.start()
    _, events = core.from_core, core.core._events_conn
    events.send_bytes(of_another_version(wire.encode(wire.Stopped())))
    await asyncio.wait_for(client._stopped.wait(), 30)
    assert not client.healthy and "wire version" in str(client.error)
    with pytest.raises(AdmissionError) as refused:
        await client.submit(req("r"))
    assert (refused.value.status, refused.value.reason) == (503, "unavailable")
    assert "wire version" in refused.value.message
    await client.shutdown(0.0)


def front_client(kind: str, engine: LLMEngine, tokenizer):
    """The client of `kind` around `engine`: in this process, or a core (threads, real pipes)."""
    if kind == "in-process":
        return InProcessClient(AsyncEngine(engine))
    return core_client(engine, tokenizer=tokenizer)[0]


def requests_in_processing(client) -> int:
    """The requests the client's output processor still tracks (0 once all are done)."""
    front = client.async_engine if isinstance(client, InProcessClient) else client
    return front._table.processor.num_tracked


@pytest.mark.parametrize("kind", ["in-process", "core-process"])
async def test_both_clients_detokenize_in_the_front_end_and_a_stop_string_ends_the_request_in_the_engine(kind):
    # The engine returns token ids only; without the stop string's abort it would run to 400 tokens.
    engine, executor = make_engine(num_blocks=256, token_fn=text_tokens("hello END there"),
                                   tokenizer=CharTokenizer())
    # The engine gives "stopped" no token past the stop string's until the front end's abort
    # is staged: the abort, not max_tokens, ends it, however fast the engine steps.
    staged, abort_request, execute = threading.Event(), engine.abort_request, executor.execute

    def recorded_abort_request(request_id, *args):
        abort_request(request_id, *args)
        staged.set()

    def held_execute(plan):
        if any(c.request.request_id == "stopped" and c.request.num_output_tokens >= 9 for c in plan.chunks):
            staged.wait(30)
        return execute(plan)

    engine.abort_request, executor.execute = recorded_abort_request, held_execute
    client = front_client(kind, engine, CharTokenizer())
    finished = Finished()
    client.add_observer(finished)
    await client.start()
    stopped = await client.submit(req("stopped", max_tokens=400, stop=["END"]))
    plain = await client.submit(req("plain", max_tokens=3))
    outs = await asyncio.wait_for(collect(stopped), 30)
    assert "".join(o.new_text for o in outs) == "hello "
    assert [o.new_text for o in outs][5:8] == [" ", "", ""]  # "E", "EN" held back, never sent
    assert (outs[-1].finish_reason, outs[-1].finish_detail) == (FinishReason.STOP, "stop_string")
    assert outs[-1].num_output_tokens == 9
    plain_outs = await asyncio.wait_for(collect(plain), 30)
    assert "".join(o.new_text for o in plain_outs) == "hel"  # text at the end of a stream, flushed
    await client.shutdown(5.0)
    in_core = {request.request_id: request for request in finished.requests}
    assert (in_core["stopped"].status, in_core["stopped"].finish_detail) == (RequestStatus.FINISHED_STOPPED,
                                                                            "stop_string")
    assert in_core["stopped"].num_output_tokens <= 10
    assert engine.scheduler.kv.num_free_blocks == 256
    assert requests_in_processing(client) == 0  # the engine's own end of it was dropped


@pytest.mark.parametrize("kind", ["in-process", "core-process"])
async def test_the_engine_steps_on_while_the_front_end_decodes(kind):
    """Text work never delays a step: while a decode of the request's text is blocked, the
    engine runs its next step. The decode waits for that step (a step thread that decoded
    would wait for itself, and the decode fail after the guard's wait)."""

    class GatedTokenizer(CharTokenizer):
        def __init__(self) -> None:
            self.decoding = threading.Event()  # a decode is blocked
            self.stepped_meanwhile = threading.Event()  # the engine ran a step since

        def decode(self, ids, **kw):
            if not self.stepped_meanwhile.is_set():
                self.decoding.set()
                if not self.stepped_meanwhile.wait(60):  # a guard, not a timing
                    raise RuntimeError("no step ran while a decode was blocked")
            return super().decode(ids, **kw)

    tokenizer = GatedTokenizer()
    engine, executor = make_engine(token_fn=text_tokens("abcdef"), tokenizer=tokenizer)
    execute, steps = executor.execute, []

    def watched_execute(plan):
        # The second step waits for the first token's decode to block (so the engine cannot
        # finish before it), then runs while it is blocked.
        if steps and not tokenizer.stepped_meanwhile.is_set():
            if tokenizer.decoding.wait(60):  # a guard, not a timing
                tokenizer.stepped_meanwhile.set()
        steps.append(plan)
        return execute(plan)

    executor.execute = watched_execute
    client = front_client(kind, engine, tokenizer)
    await client.start()
    stream = await client.submit(req("r", max_tokens=6))
    outs = await asyncio.wait_for(collect(stream), 90)
    assert (outs[-1].finish_reason, "".join(o.new_text for o in outs)) == (FinishReason.LENGTH, "abcdef")
    assert tokenizer.stepped_meanwhile.is_set()
    await client.shutdown(5.0)


@pytest.mark.parametrize("kind", ["in-process", "core-process"])
async def test_a_detokenizer_failure_in_the_front_end_ends_only_that_request(kind):
    class Fragile(CharTokenizer):
        def decode(self, ids, **kw):
            if 126 in ids:  # "~": a token this tokenizer cannot decode
                raise ValueError("undecodable")
            return super().decode(ids, **kw)

    engine, _ = make_engine(token_fn=lambda rid, pos: 126 if rid == "bad" else 97, tokenizer=Fragile())
    client = front_client(kind, engine, Fragile())
    finished = Finished()
    client.add_observer(finished)
    await client.start()
    bad = await client.submit(req("bad", max_tokens=5))
    good = await client.submit(req("good", max_tokens=5))
    bad_outs, good_outs = await asyncio.wait_for(asyncio.gather(collect(bad), collect(good)), 30)
    assert bad_outs[-1].finish_reason is FinishReason.ERROR and "undecodable" in bad_outs[-1].finish_detail
    assert good_outs[-1].finish_reason is FinishReason.LENGTH
    assert "".join(o.new_text for o in good_outs) == "aaaaa"
    await client.shutdown(5.0)
    in_core = {request.request_id: request for request in finished.requests}
    assert in_core["bad"].is_finished and in_core["good"].status is RequestStatus.FINISHED_LENGTH
    assert engine.scheduler.kv.num_free_blocks == 64
    assert requests_in_processing(client) == 0
