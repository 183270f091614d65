"""Data parallelism: one control plane drives several data planes, each with its own KV cache.

Routing is checked on its own (which data plane a sequence goes to) and through real planes:
greedy outputs equal a single data plane's, requests that share a prefix share one data
plane's cache, and a data plane killed under load loses no request: its sequences are
recomputed on the other one, and it rejoins when it is back.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from dataclasses import replace

import pytest

from tests.conftest import Planes
from tests.reliability import GREEDY, all_blocks_free, greedy_references, tokens_async, wait_until
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient
from twinplane.controlplane.router import BALANCE_SLACK, Router, prompt_block_hashes
from twinplane.controlplane.sequence import RequestParams, Sequence

DATAPLANE_ARGS = ("--block-size", "16", "--max-model-len", "512")


class FakeReplica:
    def __init__(self, index: int, load: int = 0):
        self.index, self.load = index, load
        self.describe = type("Describe", (), {"block_size": 4})()


def seq(tokens: list[int]) -> Sequence:
    return Sequence(0, "r", tokens, RequestParams(max_tokens=1))


def test_prompt_block_hashes_are_the_blocks_a_prefix_lookup_tries():
    assert len(prompt_block_hashes(list(range(8)), 4)) == 1  # the last token is never cached
    assert len(prompt_block_hashes(list(range(9)), 4)) == 2
    a, b = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), prompt_block_hashes([1, 2, 3, 4, 0, 0, 0, 0, 0], 4)
    assert a[0] == b[0] and a[1] != b[1]  # chained: equal hashes mean equal prefixes


def test_prefix_routing_follows_the_longest_prefix_unless_that_plane_is_much_busier():
    r0, r1 = FakeReplica(0), FakeReplica(1, load=1)
    router = Router("prefix")
    shared = list(range(100, 116))  # four blocks
    assert router.pick(seq(shared + [1]), [r0, r1]) is r0  # new prefix: least loaded
    r0.load = 5
    assert router.pick(seq(shared + [2, 3]), [r0, r1]) is r0  # same prefix, a little busier: still r0
    assert router.pick(seq([7] * 17), [r0, r1]) is r1  # another prefix: least loaded
    assert router.pick(seq(shared[:8] + [9] * 9), [r0, r1]) is r0  # the first two blocks are r0's
    r0.load = r1.load + BALANCE_SLACK + 1
    assert router.pick(seq(shared + [4]), [r0, r1]) is r1  # too busy: least loaded, which now holds it
    r0.load = 0
    assert router.pick(seq(shared + [5]), [r0, r1]) is r1
    router.forget(1)  # r1 lost its cache
    assert router.pick(seq(shared + [6]), [r0, r1]) is r0
    assert router.pick(seq(shared + [6]), [r1]) is r1  # only connected, able replicas are candidates


def test_round_robin_and_least_loaded_ignore_prefixes():
    r0, r1 = FakeReplica(0), FakeReplica(1, load=3)
    rr = Router("round-robin")
    assert [rr.pick(seq([1] * 9), [r0, r1]).index for _ in range(4)] == [1, 0, 1, 0]
    assert Router("least-loaded").pick(seq([1] * 9), [r1, r0]) is r0


def test_the_route_table_is_bounded():
    router = Router("prefix", max_routes=3)
    for i in range(5):
        router.pick(seq([i] * 9), [FakeReplica(0)])  # two blocks each
    assert len(router.routes) == 3


class DataParallelPlanes(Planes):
    """Two data-plane processes and one control plane that drives both."""

    def __init__(self, folder, model, dataplane_args=(), **config):
        super().__init__(folder, model, dataplane_args, **config)
        self.dp_addresses = [f"unix://{folder}/dp{i}.sock" for i in range(2)]
        self.config = replace(self.config, dataplane=",".join(self.dp_addresses))
        self.dataplanes: list[subprocess.Popen | None] = [None, None]

    def start_dataplane(self, index: int | None = None) -> None:
        for i in range(2) if index is None else (index,):
            command = [*self.dp_command]
            command[command.index("--listen") + 1] = self.dp_addresses[i]
            self.dataplanes[i] = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        super().stop()
        for process in self.dataplanes:
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(30)


@pytest.fixture
def dp_planes(tiny_qwen3_dir, tmp_path_factory):
    planes = DataParallelPlanes(tmp_path_factory.mktemp("dp"), tiny_qwen3_dir, DATAPLANE_ARGS)
    try:
        planes.start()  # ready once one data plane is connected; the tests want both
        wait_until(lambda: all(d["connected"] for d in _stats(planes)["dataplanes"]), 120, "both data planes")
        yield planes
    finally:
        planes.stop()


def _stats(planes) -> dict:
    with planes.client() as client:
        return client.stats(timeout=10)


def test_two_data_planes_give_single_plane_outputs_and_share_the_work(dp_planes, shared_planes):
    prompts = random_prompts(16, seed=501, low=10, high=60)
    expected = asyncio.run(greedy_references(shared_planes.address, prompts, 24))
    assert asyncio.run(greedy_references(dp_planes.address, prompts, 24)) == expected
    stats = _stats(dp_planes)
    assert [d["connected"] for d in stats["dataplanes"]] == [True, True]
    assert all(d["steps"] > 0 for d in stats["dataplanes"])  # both ran requests
    assert stats["steps"] == sum(d["steps"] for d in stats["dataplanes"])
    with dp_planes.client() as client:
        assert client.model_info().data_parallel_size == 2
    wait_until(lambda: all_blocks_free(dp_planes), 10, "every KV block to be free")


def test_requests_with_a_shared_prefix_share_one_data_plane_cache(dp_planes):
    """Four 64-token prefixes (four blocks each), three questions each, one request at a time: the
    first question of a prefix computes it; every later one finds all four blocks cached."""
    prefixes = random_prompts(4, seed=502, low=64, high=64)
    questions = random_prompts(12, seed=503, low=5, high=9)

    async def run() -> None:
        async with AsyncClient(dp_planes.address) as client:
            for i, question in enumerate(questions):
                await tokens_async(client, prefixes[i % 4] + question, max_tokens=2, **GREEDY)

    asyncio.run(run())
    stats = _stats(dp_planes)
    assert stats["prefix_cache_hits"] == 4 * 2 * 64
    assert sum(d["prefix_cache_hits"] for d in stats["dataplanes"]) == stats["prefix_cache_hits"]


def test_a_data_plane_killed_under_load_loses_no_request_and_rejoins(dp_planes, shared_planes):
    prompts = random_prompts(16, seed=504, low=10, high=60)
    max_tokens = 120
    expected = asyncio.run(greedy_references(shared_planes.address, prompts, max_tokens))

    async def run() -> list[list[int]]:
        async with AsyncClient(dp_planes.address) as client:
            streams = [client.generate(token_ids=p, max_tokens=max_tokens, **GREEDY).__aiter__() for p in prompts]
            firsts = [await s.__anext__() for s in streams]  # every stream is running, on both data planes
            dp_planes.dataplanes[1].send_signal(signal.SIGKILL)
            rests = await asyncio.gather(*(_rest(s) for s in streams))
            return [f.token_ids + r for f, r in zip(firsts, rests)]

    assert asyncio.run(run()) == expected  # the killed plane's streams finished on the other one
    dp_planes.dataplanes[1].wait(10)
    with dp_planes.client() as client:
        assert client.health_status(5.0) == "SERVING"  # one data plane is enough to serve
    assert [d["connected"] for d in _stats(dp_planes)["dataplanes"]] == [True, False]
    dp_planes.start_dataplane(1)
    wait_until(lambda: _stats(dp_planes)["dataplanes"][1]["connected"], 120, "the data plane to rejoin")
    steps_before = _stats(dp_planes)["dataplanes"][1]["steps"]
    asyncio.run(greedy_references(dp_planes.address, random_prompts(8, seed=505, low=10, high=60), 8))
    assert _stats(dp_planes)["dataplanes"][1]["steps"] > steps_before  # it takes requests again
    wait_until(lambda: all_blocks_free(dp_planes), 10, "every KV block to be free")


async def _rest(chunks) -> list[int]:
    return [t async for chunk in chunks for t in chunk.token_ids]
