"""Several frontend processes on one loopback port (--api-server-count), all driving one engine core.

Which frontend a connection reaches is the kernel's choice (SO_REUSEPORT), so the tests open
connections of their own until GetStats, which says which frontend answered, has shown each
frontend at least twice: every check below then runs on streams of every frontend.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from tests.reliability import (DRAIN_LONG, DRAIN_MODEL, DRAIN_SHORT, GREEDY, ProcessLog, all_blocks_free,
                               greedy_references, running_streams, tokens_async, wait_until)
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient, Client
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.fanout import Frontends, owner, seq_ids
from twinplane.controlplane.messages import (CoreSnapshot, Heartbeat, Refused, Rejected, Snapshot, Stalled, StepFailed,
                                             StepOutputs, TokenOutput)

CLI = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING"]
DP_ARGS = ("--block-size", "16", "--max-model-len", "512")
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # not one connection shared by every channel
MAX_CONNECTIONS = 200  # the chance that this many all reach the same one of 2 frontends is 2**-199
pytestmark = pytest.mark.timeout(300)


async def _clients_by_frontend(address: str, count: int, per_frontend: int = 2) -> dict[int, list[AsyncClient]]:
    """Opens connections until each of count frontends answered per_frontend of them; the others are closed."""
    found: dict[int, list[AsyncClient]] = {i: [] for i in range(count)}
    for _ in range(MAX_CONNECTIONS):
        client = AsyncClient(address, options=OWN_CONNECTION)
        await client.wait_ready(timeout=60)
        stats = await client.stats()
        assert stats["api_server_count"] == count
        if len(found[stats["frontend"]]) < per_frontend:
            found[stats["frontend"]].append(client)
        else:
            await client.close()
        if all(len(clients) == per_frontend for clients in found.values()):
            return found
    raise AssertionError(f"{MAX_CONNECTIONS} connections did not reach every frontend: {found}")


async def _close(found: dict[int, list[AsyncClient]]) -> None:
    await asyncio.gather(*(c.close() for clients in found.values() for c in clients))


def test_sequence_ids_are_distinct_and_name_their_frontend():
    ids = {index: [next(it) for _ in range(50)] for index, it in ((i, seq_ids(i, 3)) for i in range(3))}
    assert len({s for values in ids.values() for s in values}) == 150 and min(ids[0]) > 0
    assert all(owner(s, 3) == index for index, values in ids.items() for s in values)
    assert list(itertools.islice(seq_ids(0, 1), 3)) == [1, 2, 3] and owner(7, 1) == 0  # one frontend: as before


def test_the_core_tells_only_the_owner_of_a_request_that_it_failed():
    class Channel:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    channels = [Channel() for _ in range(3)]
    frontends = Frontends(channels)
    frontends.send(Rejected(7, "top_k out of range"))
    frontends.send(Refused([(3, "too long"), (4, "too long"), (6, "too long")]))
    assert [c.sent for c in channels] == [[Refused([(3, "too long"), (6, "too long")])],
                                          [Rejected(7, "top_k out of range"), Refused([(4, "too long")])], []]


class _Channel:
    """Stands in for a channel to a frontend: keeps what it is sent, as the frontend would read it."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def send_encoded(self, data: bytes):
        self.sent.append(pickle.loads(data[4:]))


def test_each_frontend_hears_the_tokens_of_its_own_sequences_and_everyone_the_rest():
    """A step's tokens go to the frontends that own their sequences, with the snapshot (one that owns
    none of them gets the snapshot alone); a failed step to the owners of the sequences in it; the
    rest (heartbeats, stalls) to every frontend."""
    channels = [_Channel() for _ in range(3)]
    frontends, snapshot = Frontends(channels), CoreSnapshot({"steps": 1})

    def token(seq_id: int) -> TokenOutput:
        return TokenOutput(seq_id, 5, 3, None, None, 0)

    frontends.send(StepOutputs([token(3), token(4), token(6)], snapshot))
    frontends.send(StepFailed([4, 9, 7], "out of memory"))
    frontends.send(Heartbeat())
    frontends.send(Stalled(True))
    everyone, failed = [Heartbeat(), Stalled(True)], "out of memory"
    assert channels[0].sent == [StepOutputs([token(3), token(6)], snapshot), StepFailed([9], failed), *everyone]
    assert channels[1].sent == [StepOutputs([token(4)], snapshot), StepFailed([4, 7], failed), *everyone]
    assert channels[2].sent == [Snapshot(snapshot), *everyone]


def test_a_unix_socket_cannot_be_shared_by_several_frontends(tmp_path):
    with pytest.raises(ValueError, match="cannot be shared"):
        ControlPlaneConfig(dataplane="unix:///dp.sock", listen=f"unix://{tmp_path}/cp.sock", api_server_count=2)
    for count in (0, 65):
        with pytest.raises(ValueError, match=rf"api_server_count must be in \[1, 64\] \(frontend \w+\), got {count}"):
            ControlPlaneConfig(dataplane="unix:///dp.sock", api_server_count=count)
    ControlPlaneConfig(dataplane="unix:///dp.sock", api_server_count=64, max_waiting_requests=64)
    with pytest.raises(ValueError, match="split between the 4 frontends"):
        ControlPlaneConfig(dataplane="unix:///dp.sock", api_server_count=4, max_waiting_requests=3)
    result = subprocess.run([*CLI, "controlplane", "--listen", f"unix://{tmp_path}/cp.sock",
                             "--api-server-count", "2"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot be shared" in result.stderr


async def _streams(found: dict[int, list[AsyncClient]], prompts: list[list[int]], max_tokens: int):
    """running_streams, spread over every connection (so over every frontend)."""
    return await running_streams([c for clients in found.values() for c in clients], prompts, max_tokens)


def test_two_frontends_stream_what_one_does_and_carry_on_past_a_killed_core(tiny_qwen3_dir, planes_factory):
    # the kill, once each stream has 3 tokens, must cut every stream: beside other work one was seen 97 tokens ahead
    # of the last to start (13 on an idle machine); max_model_len (512) leaves room for 400
    prompts, max_tokens = random_prompts(16, seed=601, low=10, high=60), 400
    one = planes_factory(tiny_qwen3_dir, *DP_ARGS)
    expected = asyncio.run(greedy_references(one.address, prompts, max_tokens))
    one.stop()
    two = planes_factory(tiny_qwen3_dir, *DP_ARGS, listen="127.0.0.1:0", api_server_count=2)
    assert two.address.startswith("127.0.0.1:")

    async def run() -> tuple[list, list, list, dict]:
        found = await _clients_by_frontend(two.address, 2)
        try:
            streams, _ = await _streams(found, prompts, max_tokens)
            together = list(await asyncio.gather(*streams))
            streams, seen = await _streams(found, prompts, max_tokens)
            two.engine.supervisor.process.send_signal(signal.SIGKILL)  # streams in flight on both frontends
            at_kill = list(seen)
            past_kill = list(await asyncio.gather(*streams))
            stats = {i: await clients[0].stats() for i, clients in found.items()}
        finally:
            await _close(found)
        return together, past_kill, at_kill, stats

    together, past_kill, at_kill, stats = asyncio.run(run())
    assert together == expected  # greedy output identical to one frontend's
    assert max(at_kill) < max_tokens and past_kill == expected  # replayed to the next core, nothing lost
    assert stats[0]["frontend"] == 0 and stats[1]["frontend"] == 1
    assert stats[0]["steps"] > 0 and abs(stats[0]["steps"] - stats[1]["steps"]) < 50  # one core's numbers
    # the primary's /metrics counts both frontends' requests (the other's as reported every 0.5 s)
    secondaries = two.plane.secondaries
    wait_until(lambda: 1 in secondaries.metrics and sum(two.engine.metrics.finished.values())
               + sum(secondaries.metrics[1].finished.values()) == 2 * len(prompts), 10, "both frontends' counts")
    assert sum(secondaries.metrics[1].finished.values()) > 0 and sum(two.engine.metrics.finished.values()) > 0
    wait_until(lambda: all_blocks_free(two), 10, "every KV block to be free")


async def _sigterm_on_two_frontends(address: str, control: subprocess.Popen) -> dict:
    report = {}
    found = await _clients_by_frontend(address, 2, per_frontend=1)
    try:
        clients = [found[0][0], found[1][0]]
        shorts = [c.generate(token_ids=[11 + i] * 20, max_tokens=DRAIN_SHORT, **GREEDY).__aiter__()
                  for i, c in enumerate(clients)]
        longs = [c.generate(token_ids=[21 + i] * 20, max_tokens=DRAIN_LONG, **GREEDY).__aiter__()
                 for i, c in enumerate(clients)]
        firsts = [await stream.__anext__() for stream in shorts + longs]
        control.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for client in clients:  # until each frontend has taken the signal
            while await client.health_status(timeout=5) == "SERVING" and time.monotonic() - signalled < 20:
                await asyncio.sleep(0.05)
        report["new_requests"] = []
        for client in clients:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokens_async(client, [13] * 5, max_tokens=3, timeout=10, **GREEDY)
            report["new_requests"].append(refused.value.code())
        report["shorts"] = []
        for first, stream in zip(firsts, shorts):  # an async comprehension in a plain one needs Python 3.11
            report["shorts"].append(len(first.token_ids) + sum([len(c.token_ids) async for c in stream]))
        report["longs"] = []
        for stream in longs:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in stream:
                    pass
            report["longs"].append((ended.value.code(), time.monotonic() - signalled))
    finally:
        await _close(found)
    return report


def test_sigterm_drains_every_frontend_and_a_dead_frontend_stops_the_control_plane(tmp_path):
    grace = 6.0
    dp_address = f"unix://{tmp_path}/dp.sock"
    dataplane = subprocess.Popen([*CLI, "dataplane", *DRAIN_MODEL, "--listen", dp_address], stdin=subprocess.DEVNULL)

    def control_plane() -> tuple[subprocess.Popen, ProcessLog, str, list[psutil.Process]]:
        # on any free port, which its start-up line (INFO) names
        control = subprocess.Popen([*CLI, "controlplane", "--log-level", "INFO", "--dataplane", dp_address,
                                    "--listen", "127.0.0.1:0", "--shutdown-grace", str(grace),
                                    "--api-server-count", "2"], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        log = ProcessLog(control)
        address = log.listening_address()
        with Client(address) as client:
            client.wait_ready(timeout=120)
        return control, log, address, psutil.Process(control.pid).children()

    started: list[subprocess.Popen] = []
    try:
        control, log, address, children = control_plane()
        started.append(control)
        assert len(children) == 2  # the other frontend and the engine core
        report = asyncio.run(_sigterm_on_two_frontends(address, control))
        assert report["new_requests"] == [grpc.StatusCode.UNAVAILABLE] * 2  # both stop accepting at once
        assert report["shorts"] == [DRAIN_SHORT, DRAIN_SHORT]  # in-flight streams finish within the grace period
        assert [code for code, _ in report["longs"]] == [grpc.StatusCode.UNAVAILABLE] * 2
        assert grace - 1.0 < report["longs"][0][1] < grace + 5  # ended when the grace period ran out
        assert control.wait(grace + 20) == 0
        assert "Traceback" not in log.rest()
        psutil.wait_procs(children, timeout=10)
        assert not any(child.is_running() for child in children)

        control, log, address, children = control_plane()  # a frontend that dies stops the whole control plane
        started.append(control)
        secondary = next(c for c in children if b"frontends" in " ".join(c.cmdline()).encode())
        secondary.kill()
        assert control.wait(grace + 20) == 1
        stderr = log.rest()
        assert f"frontend 1 (pid {secondary.pid}) exited" in stderr.splitlines()[-1], stderr[-2000:]
        psutil.wait_procs(children, timeout=10)
        assert not any(child.is_running() for child in children)
    finally:
        for process in (*started, dataplane):
            if process.poll() is None:
                process.kill()
                process.wait(10)
