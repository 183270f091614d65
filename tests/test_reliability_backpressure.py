"""Back-pressure: a bounded waiting queue; beyond it RESOURCE_EXHAUSTED at once, and memory stays bounded."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from tests.reliability import GREEDY, all_blocks_free, wait_until
from twinplane.clients.client import AsyncClient

MAX_WAITING, MAX_RUNNING, NUM_CALLS, MAX_TOKENS = 4, 2, 30, 100


@pytest.fixture(scope="module")
def small_queue(tiny_qwen3_dir, tmp_path_factory):
    from tests.conftest import Planes

    planes = Planes(tmp_path_factory.mktemp("queue"), tiny_qwen3_dir,
                    ("--block-size", "16", "--max-model-len", "512", "--max-num-seqs", str(MAX_RUNNING)),
                    max_waiting_requests=MAX_WAITING).start()
    yield planes
    planes.stop()


async def _one(client: AsyncClient, i: int, timeout: float = 60) -> tuple[str, float, object]:
    """('ok', seconds, tokens) or ('error', seconds, RpcError)."""
    started = time.monotonic()
    try:
        tokens = [t async for c in client.generate(token_ids=[5 + i] * 10, max_tokens=MAX_TOKENS, timeout=timeout,
                                                   **GREEDY) for t in c.token_ids]
        return "ok", time.monotonic() - started, tokens
    except grpc.aio.AioRpcError as error:
        return "error", time.monotonic() - started, error


async def _burst(address: str, n: int, timeout: float = 60) -> list[tuple[str, float, object]]:
    async with AsyncClient(address) as client:
        return list(await asyncio.gather(*(_one(client, i, timeout) for i in range(n))))


async def _watch_queue(engine, peaks: dict) -> None:
    while True:
        peaks["waiting"] = max(peaks["waiting"], engine.num_waiting)
        peaks["requests"] = max(peaks["requests"], len(engine.requests))
        await asyncio.sleep(0.001)  # not a busy loop: it would slow the calls it watches


def test_beyond_the_queue_requests_are_refused_at_once(small_queue):
    peaks = {"waiting": 0, "requests": 0}
    watcher = asyncio.run_coroutine_threadsafe(_watch_queue(small_queue.engine, peaks), small_queue.loop)
    try:
        results = asyncio.run(_burst(small_queue.address, NUM_CALLS))
    finally:
        watcher.cancel()
    served = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "error"]
    assert all(r[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), [r[2] for r in refused]
    assert all("max_waiting_requests" in r[2].details() for r in refused)
    # the queue always takes MAX_WAITING; how many start running before the burst fills it is timing
    assert len(refused) >= NUM_CALLS // 2 and len(served) >= MAX_WAITING
    assert max(r[1] for r in refused) < 5.0  # refused at once, not after waiting
    assert all(len(r[2]) == MAX_TOKENS for r in served)
    # memory is bounded: never more than max_waiting_requests queued, nor more than queued + running held
    assert peaks["waiting"] <= MAX_WAITING
    assert peaks["requests"] <= MAX_WAITING + MAX_RUNNING
    wait_until(lambda: all_blocks_free(small_queue), 10, "every KV block to be free")
    assert all(r[0] == "ok" for r in asyncio.run(_burst(small_queue.address, MAX_WAITING)))


def test_requests_being_parsed_count_against_the_queue(small_queue, monkeypatch):
    """A burst whose parse takes long (a large schema's grammar compiles for up to a second) queues no more
    parses than max_waiting_requests: the rest are refused before theirs starts."""
    import threading

    from twinplane.controlplane import server

    parsing, parse, release = [], server.generate_call_from_pb, threading.Event()

    def slow(*args):  # held until the whole burst has come, however long that takes on a loaded machine
        parsing.append(threading.get_ident())
        release.wait(60)
        return parse(*args)

    admitted, wait_ready = [], small_queue.engine.wait_ready

    async def counted(*args, **kwargs):  # each call's admission: its parse starts (or it is refused) right after
        try:
            return await wait_ready(*args, **kwargs)
        finally:
            admitted.append(None)

    async def burst() -> list[tuple[str, float, object]]:
        async with AsyncClient(small_queue.address) as client:
            calls = [asyncio.ensure_future(_one(client, i)) for i in range(MAX_WAITING + 6)]
            deadline = time.monotonic() + 60
            while len(admitted) < len(calls):  # every call has come and was let in to parse or refused
                assert time.monotonic() < deadline, f"{len(admitted)} of the burst's {len(calls)} calls came"
                await asyncio.sleep(0.02)
            release.set()
            return list(await asyncio.gather(*calls))

    monkeypatch.setattr(server, "generate_call_from_pb", slow)
    monkeypatch.setattr(small_queue.engine, "wait_ready", counted)
    try:
        results = asyncio.run(burst())
    finally:
        release.set()
    refused = [r for r in results if r[0] == "error"]
    assert len(parsing) == MAX_WAITING and len(refused) == 6, (len(parsing), [r[2] for r in refused])
    assert all(r[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    wait_until(lambda: all_blocks_free(small_queue), 10, "every KV block to be free")


def test_calls_waiting_for_a_data_plane_count_against_the_queue(small_queue):
    """During an outage new requests wait, but no more than max_waiting_requests of them."""
    small_queue.dataplane.send_signal(signal.SIGKILL)
    small_queue.dataplane.wait(10)
    wait_until(lambda: not small_queue.engine.ready.is_set(), 10, "the control plane to notice the loss")

    async def outage() -> list[tuple[str, float, object]]:
        burst = asyncio.ensure_future(_burst(small_queue.address, MAX_WAITING + 3, timeout=120))
        deadline = time.monotonic() + 20
        while small_queue.engine.num_waiting_ready < MAX_WAITING and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # and no more than that
        assert small_queue.engine.num_waiting_ready == MAX_WAITING
        await asyncio.to_thread(small_queue.start_dataplane)
        return await burst

    results = asyncio.run(outage())
    refused = [r for r in results if r[0] == "error"]
    assert len(refused) == 3 and all(r[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert all(r[1] < 5.0 for r in refused)  # at once, not when the data plane is back
    served = [r for r in results if r[0] == "ok"]
    assert len(served) == MAX_WAITING and all(len(r[2]) == MAX_TOKENS for r in served)
    wait_until(lambda: all_blocks_free(small_queue), 10, "every KV block to be free")


def test_requests_waiting_for_a_new_engine_core_count_as_waiting():
    """A core that dies leaves every request in flight waiting for the next one: they count as waiting
    (gauges, max_waiting_requests) until the new core reports them admitted."""
    from twinplane.controlplane.api import GenerateCall, Prompt
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.errors import Overloaded
    from twinplane.controlplane.messages import AddRequest, CoreSnapshot, DataPlaneSnapshot
    from twinplane.controlplane.replica import STAT_NAMES
    from twinplane.controlplane.sequence import RequestParams
    from twinplane.proto import dataplane_pb2 as dp

    class Link:
        def __init__(self, config, engine):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    def snapshot(added: int, running: int) -> CoreSnapshot:
        return CoreSnapshot(dict.fromkeys(STAT_NAMES, 0), num_added=added, added_by_frontend=(added,),
                            waiting_by_frontend=(0,), dataplanes=[DataPlaneSnapshot("dp", True, 0, running)])

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere", max_waiting_requests=3), link=Link)
    describe = dp.DescribeResponse(model="m", vocab_size=100, max_model_len=64, num_kv_blocks=16, block_size=16,
                                   max_logprobs=5)

    async def run():
        engine.connected(describe, snapshot(0, 0))
        for i in range(3):
            await engine.add(GenerateCall(f"r{i}", Prompt(token_ids=[1, 2, 3]), RequestParams(max_tokens=8)))
        engine.snapshot(snapshot(3, 3))  # the core admitted all three
        assert engine.num_waiting == 0
        engine.core_died()
        assert engine.num_waiting == 3
        with pytest.raises(Overloaded, match="too many waiting requests \\(3, max_waiting_requests 3\\)"):
            await engine.add(GenerateCall("r3", Prompt(token_ids=[1]), RequestParams(max_tokens=8)))
        engine.supervisor.sent.clear()
        engine.connected(describe, snapshot(0, 0))  # the new core: the three go to it
        assert [m.seq_id for m in engine.supervisor.sent if isinstance(m, AddRequest)] == [1, 2, 3]
        assert engine.num_waiting == 3  # on their way to it
        engine.snapshot(snapshot(3, 3))
        assert engine.num_waiting == 0

    asyncio.run(run())
    engine._tokenizer_pool.shutdown()
