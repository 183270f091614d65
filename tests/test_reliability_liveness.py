"""A hung or dead process is noticed and recovered from, and no request is lost.

A data plane or an engine core that stops answering (SIGSTOP) turns health NOT_SERVING within
the stall bound and back to SERVING once it answers again (SIGCONT); one silent past its longer
bound is dropped (data plane: reconnect) or killed and restarted (engine core). A core that dies
is restarted; the requests in flight carry on on the new core with the same greedy tokens, and
the data plane process is reused. Bounds here are generous: loaded CI machines are slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tests.faulty_dataplane import SLOW_SECONDS, SLOW_TOKEN
from tests.reliability import GREEDY, all_blocks_free, greedy_references, running_streams, tokens_async, wait_until
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient
from twinplane.controlplane import liveness
from twinplane.controlplane.liveness import Silence

NUM_STREAMS, MAX_TOKENS = 8, 100
# the kill, once each stream has 3 tokens, must cut every stream: beside other work one was seen 97 tokens ahead
# of the last to start (12 on an idle machine); max_model_len (512) leaves room for 400
KILL_MAX_TOKENS = 400
DP_ARGS = ("--block-size", "16", "--max-model-len", "512")
STALL = 2.0  # stall_timeout of these tests' control planes
NOTICE_BOUND = 20.0  # seconds a test waits for health to change: the bound plus a loaded machine's delays
pytestmark = pytest.mark.timeout(300)


async def _wait_health(client: AsyncClient, want: str, timeout: float) -> float:
    """Polls health until it says want; returns the seconds it took."""
    started = time.monotonic()
    while (status := await client.health_status(2.0)) != want:
        if time.monotonic() - started > timeout:
            raise AssertionError(f"health stayed {status} for {timeout:.0f} s, waiting for {want}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def _across_a_pause(planes, pid: int, prompts: list[list[int]], paused: float) -> dict:
    """Runs streams; SIGSTOPs pid once each has tokens; SIGCONTs it after paused seconds (at least
    until health says NOT_SERVING); returns the outputs and how long health took to change."""
    report = {}
    async with AsyncClient(planes.address) as client:
        streams, seen = await running_streams([client], prompts, MAX_TOKENS)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            report["to_not_serving"] = await _wait_health(client, "NOT_SERVING", NOTICE_BOUND)
            report["seen_while_stopped"] = list(seen)
            await asyncio.sleep(max(0.0, paused - (time.monotonic() - stopped)))
        finally:
            with contextlib.suppress(ProcessLookupError):  # a core killed past core_timeout is gone
                os.kill(pid, signal.SIGCONT)
        report["to_serving"] = await _wait_health(client, "SERVING", 60)
        report["outputs"] = list(await asyncio.gather(*streams))
        report["after"] = await tokens_async(client, prompts[0], max_tokens=MAX_TOKENS, **GREEDY)
    print(f"\nSIGSTOP -> NOT_SERVING {report['to_not_serving']:.2f} s, "
          f"SIGCONT -> SERVING {report['to_serving']:.2f} s", flush=True)
    return report


def _check(report: dict, expected: list[list[int]], planes) -> None:
    # streams were cut mid-way (on a loaded machine, streams that started early may end before the stop)
    assert min(report["seen_while_stopped"]) < MAX_TOKENS, report["seen_while_stopped"]
    assert report["outputs"] == expected  # every stream finished, no token lost or repeated
    assert report["after"] == expected[0]
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")


@pytest.mark.parametrize("dataplane_timeout", [120.0, 4.0], ids=["resumed", "reconnected"])
def test_a_hung_data_plane_is_noticed_and_its_streams_finish(tiny_qwen3_dir, planes_factory, dataplane_timeout):
    """Stopped for 6 s: with a long dataplane_timeout the Step stream resumes as it was; with a
    short one the control plane drops it, reconnects once the data plane answers and recomputes."""
    planes = planes_factory(tiny_qwen3_dir, *DP_ARGS, stall_timeout=STALL, dataplane_timeout=dataplane_timeout)
    prompts = random_prompts(NUM_STREAMS, seed=501, low=10, high=60)
    expected = asyncio.run(greedy_references(planes.address, prompts, MAX_TOKENS))
    lost = []
    planes.call(_count_calls(planes.engine, "lost", lost))
    dp_pid = planes.dataplane.pid
    report = asyncio.run(_across_a_pause(planes, dp_pid, prompts, paused=6.0))
    assert report["to_not_serving"] < NOTICE_BOUND
    _check(report, expected, planes)
    assert bool(lost) == (dataplane_timeout < 6.0), lost  # dropped and connected again only past the timeout
    assert planes.dataplane.pid == dp_pid and planes.dataplane.poll() is None


def test_an_idle_data_plane_that_goes_silent_is_noticed_by_keepalive(tiny_qwen3_dir, planes_factory):
    """No step is due, so only keepalive pings find the silent data plane (within dataplane_timeout)."""
    planes = planes_factory(tiny_qwen3_dir, *DP_ARGS, stall_timeout=STALL, dataplane_timeout=4.0)

    async def run() -> tuple[float, list[int]]:
        async with AsyncClient(planes.address) as client:
            os.kill(planes.dataplane.pid, signal.SIGSTOP)
            try:
                noticed = await _wait_health(client, "NOT_SERVING", NOTICE_BOUND)
            finally:
                os.kill(planes.dataplane.pid, signal.SIGCONT)
            await _wait_health(client, "SERVING", 60)
            return noticed, await tokens_async(client, [7] * 10, max_tokens=5, timeout=60, **GREEDY)

    noticed, tokens = asyncio.run(run())
    print(f"\nidle data plane SIGSTOP -> NOT_SERVING {noticed:.2f} s", flush=True)
    assert noticed < NOTICE_BOUND and len(tokens) == 5


def test_a_step_result_that_does_not_come_is_given_up_on(tiny_qwen3_dir, planes_factory):
    """The data plane answers keepalive pings but sits on one step for SLOW_SECONDS: health turns
    NOT_SERVING after stall_timeout, the Step stream is dropped after dataplane_timeout, and the
    control plane's Reset and new stream go through once the data plane's old stream has ended."""
    script = Path(__file__).with_name("faulty_dataplane.py")
    planes = planes_factory(tiny_qwen3_dir, *DP_ARGS, dp_program=(str(script),), stall_timeout=STALL,
                            dataplane_timeout=3.0)
    prompts = random_prompts(4, seed=504, low=10, high=60) + [[SLOW_TOKEN, 5, 6, 7]]
    lost = []
    planes.call(_count_calls(planes.engine, "lost", lost))

    async def run() -> tuple[float, list[list[int]]]:
        async with AsyncClient(planes.address) as client:
            streams = [tokens_async(client, p, max_tokens=MAX_TOKENS, timeout=120, **GREEDY) for p in prompts]
            streams = [asyncio.ensure_future(s) for s in streams]
            noticed = await _wait_health(client, "NOT_SERVING", NOTICE_BOUND)
            return noticed, list(await asyncio.gather(*streams))

    noticed, outputs = asyncio.run(run())
    assert noticed < SLOW_SECONDS and lost  # NOT_SERVING while the step hung; the stream was given up
    assert outputs == asyncio.run(greedy_references(planes.address, prompts, MAX_TOKENS))  # slow only once
    assert planes.dataplane.poll() is None


async def _count_calls(engine, name: str, calls: list) -> None:
    """Records each call of engine.<name> that a message from the core makes (receive() looks the
    method up at each message)."""
    method = getattr(engine, name)

    def counted(*args):
        calls.append(args)
        method(*args)

    setattr(engine, name, counted)


@pytest.mark.parametrize("core_timeout", [120.0, 3.0], ids=["resumed", "restarted"])
def test_a_hung_engine_core_is_noticed_and_its_streams_finish(tiny_qwen3_dir, planes_factory, core_timeout, caplog):
    """Stopped for 8 s: with a long core_timeout the core carries on; with a short one it is
    killed and a new core takes over the streams."""
    caplog.set_level(logging.WARNING, "twinplane.controlplane")
    planes = planes_factory(tiny_qwen3_dir, *DP_ARGS, stall_timeout=STALL, core_timeout=core_timeout)
    prompts = random_prompts(NUM_STREAMS, seed=502, low=10, high=60)
    expected = asyncio.run(greedy_references(planes.address, prompts, MAX_TOKENS))
    core = planes.engine.supervisor.process
    report = asyncio.run(_across_a_pause(planes, core.pid, prompts, paused=8.0))
    assert report["to_not_serving"] < NOTICE_BOUND
    _check(report, expected, planes)
    restarted = planes.engine.supervisor.process is not core
    assert restarted == (core_timeout < 8.0)
    said = [r.getMessage() for r in caplog.records]
    answered = said.count("the engine core answers again")  # a loaded machine may add a stall of its own
    assert (answered == 0) if restarted else (answered >= 1), said  # a killed core never does
    assert planes.dataplane.poll() is None


async def _across_a_core_kill(planes, prompts: list[list[int]], max_tokens: int) -> dict:
    report = {}
    async with AsyncClient(planes.address) as client:
        streams, seen = await running_streams([client], prompts, max_tokens)
        core = planes.engine.supervisor.process
        report["steps_before"] = planes.engine.core_snapshot.stats["steps"]
        core.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        report["seen_at_kill"] = list(seen)
        report["to_not_serving"] = await _wait_health(client, "NOT_SERVING", NOTICE_BOUND)
        report["to_serving"] = await _wait_health(client, "SERVING", 120) + report["to_not_serving"]
        report["restarted_in"] = time.monotonic() - killed
        report["outputs"] = list(await asyncio.gather(*streams))
        report["after"] = await tokens_async(client, prompts[0], max_tokens=max_tokens, **GREEDY)
        report["new_core"] = planes.engine.supervisor.process is not core
    print(f"\ncore SIGKILL -> NOT_SERVING {report['to_not_serving']:.2f} s, SERVING again after "
          f"{report['restarted_in']:.2f} s", flush=True)
    return report


def test_a_killed_engine_core_is_restarted_and_its_streams_finish(tiny_qwen3_dir, planes_factory):
    planes = planes_factory(tiny_qwen3_dir, *DP_ARGS)
    prompts = random_prompts(NUM_STREAMS, seed=503, low=10, high=60)
    expected = asyncio.run(greedy_references(planes.address, prompts, KILL_MAX_TOKENS))
    dp_pid = planes.dataplane.pid
    report = asyncio.run(_across_a_core_kill(planes, prompts, KILL_MAX_TOKENS))
    assert max(report["seen_at_kill"]) < KILL_MAX_TOKENS
    assert report["new_core"]
    assert report["outputs"] == expected  # carried on by the new core: no token lost or repeated
    assert report["after"] == expected[0]
    assert planes.dataplane.pid == dp_pid and planes.dataplane.poll() is None  # the same data plane
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")
    assert planes.engine.core_snapshot.stats["steps"] > report["steps_before"] > 0  # counters carried on


def test_a_request_that_outlives_two_cores_fails_with_unavailable(tiny_qwen3_dir, planes_factory):
    """A request in flight when two cores died may be what kills them: it is not tried a third time."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    with planes.client() as client:
        stream = iter(client.generate(token_ids=[5] * 20, max_tokens=4000, timeout=120, **GREEDY))
        next(stream)
        for _ in range(2):
            core = planes.engine.supervisor.process
            wait_until(lambda: planes.engine.ready.is_set(), 60, "a core with a data plane")
            os.kill(core.pid, signal.SIGKILL)
            wait_until(lambda: planes.engine.supervisor.process is not core, 60, "a new core")
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine core stopped 2 times" in info.value.details()
        client.wait_ready(timeout=60)
        assert len([t for c in client.generate(token_ids=[5] * 20, max_tokens=5, **GREEDY) for t in c.token_ids]) == 5
    assert not planes.engine.crashed.is_set()


def test_silence_counts_from_the_first_tick_that_hears_nothing():
    silence = Silence()
    assert silence.tick(True, 1.0) == 0.0
    assert silence.tick(False, 1.0) == 0.0  # a late tick does not count the time before it went quiet
    assert silence.tick(False, 0.5) == 0.5 and silence.tick(False, 0.5) == 1.0
    assert silence.tick(True, 0.5) == 0.0 and silence.tick(False, 0.5) == 0.0


def test_each_tick_counts_the_time_since_the_last_and_a_late_one_two_intervals_at_most(monkeypatch):
    """A tick that comes late (the process was stopped or starved) counts two intervals, not the time
    it lost; the tick after it counts from the late one."""
    clock = iter([10.0, 10.5, 11.0, 14.0, 14.5, 15.0])

    async def no_wait(_seconds):
        pass

    loop = SimpleNamespace(time=lambda: next(clock))
    monkeypatch.setattr(liveness, "asyncio", SimpleNamespace(get_running_loop=lambda: loop, sleep=no_wait))

    async def first_ticks(count: int) -> list[float]:
        elapsed = []
        async for seconds in liveness.ticks(0.5):
            elapsed.append(seconds)
            if len(elapsed) == count:
                return elapsed

    assert asyncio.run(first_ticks(5)) == [0.5, 0.5, 1.0, 0.5, 0.5]
