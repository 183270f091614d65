"""Data parallelism: one control plane drives several data planes, each with its own KV cache.

Routing is checked on its own (which data plane a sequence goes to) and through real planes:
greedy outputs equal a single data plane's, requests that share a prefix share one data
plane's cache, and a data plane killed under load loses no request: its sequences are
recomputed on the other one, and it rejoins when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import Planes
from tests.reliability import (GREEDY, StderrLog, all_blocks_free, greedy_references, stop_process, tokens_async,
                               wait_until)
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient
from twinplane.controlplane.messages import AddRequest
from twinplane.controlplane.router import BALANCE_SLACK, Router, prompt_block_hashes
from twinplane.controlplane.sequence import RequestParams, Sequence

DATAPLANE_ARGS = ("--block-size", "16", "--max-model-len", "512")


class FakeReplica:
    def __init__(self, index: int, load: int = 0, max_num_seqs: int = 256):
        self.index, self.load, self.max_num_seqs = index, load, max_num_seqs
        self.describe = type("Describe", (), {"block_size": 4})()

    @property
    def has_room(self) -> bool:
        return self.load < self.max_num_seqs


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


def test_prefix_routing_takes_the_longest_prefix_held_and_the_balance_slack_exactly():
    r0, r1 = FakeReplica(0), FakeReplica(1, load=1)
    router = Router("prefix")
    a, b, c = [1] * 4, [2] * 4, [3] * 4  # blocks
    assert router.pick(seq(a + b + [0]), [r0, r1]) is r0
    r0.load = r1.load + BALANCE_SLACK + 1
    assert router.pick(seq(a + c + [0]), [r0, r1]) is r1  # r0 too busy: a's block is now routed to r1
    r0.load = r1.load + BALANCE_SLACK  # busier by the slack exactly: still the holder
    assert router.pick(seq(a + b + [4] * 4 + [0]), [r0, r1]) is r0  # a+b (r0's) is longer than a (r1's)


def test_a_full_prefix_holder_passes_new_sequences_to_one_with_room():
    """Requests that share a system prompt fill its data plane up to max_num_seqs (4 here), then go to the
    other, which holds the prefix from then on; once both are full, the prefix's holder takes them."""
    async def run():
        core = _core_of_two(TokensSeen())
        shared = list(range(100, 116))
        for seq_id in range(12):
            core.add(AddRequest(seq_id, f"r{seq_id}", shared + [seq_id], RequestParams(max_tokens=4)))
        return [core.replica_of[seq_id].index for seq_id in range(12)]

    assert asyncio.run(run()) == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    holder, full, roomy = FakeReplica(0, 4, max_num_seqs=4), FakeReplica(1, 2, max_num_seqs=2), FakeReplica(2, 3)
    router = Router("prefix")
    router.pick(seq(list(range(100, 117))), [holder])
    assert router.pick(seq(list(range(100, 118))), [holder, full, roomy]) is roomy  # the least loaded is full too


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


class ScriptedStream:
    """A data plane's step stream that answers each plan at once (token 100 + step id for each sampled row);
    with lose_at, the stream ends while that result is being read: gRPC runs the call's done callback first,
    then hands over the result it had already buffered."""

    def __init__(self, replica, lose_at: int | None = None):
        self.replica, self.lose_at, self.lost, self.num_read = replica, lose_at, False, 0
        self.results: asyncio.Queue = asyncio.Queue()

    async def send(self, plan) -> None:
        from twinplane.proto import dataplane_pb2 as dp

        sampled = np.full(int(np.frombuffer(plan.sample, np.uint8).sum()), 100 + plan.step_id, "<i4")
        await self.results.put(dp.StepResult(step_id=plan.step_id, sampled_token_ids=sampled.tobytes()))

    async def receive(self):
        result = await self.results.get()
        self.num_read += 1
        if self.num_read == self.lose_at:
            self.lost = True
            self.replica._on_dataplane_lost()
        return result

    async def close(self) -> None:
        pass


def _core_of_two(frontend, lose_at: int | None = None):
    """An engine core over two data planes that answer through ScriptedStream; the first one's stream ends at
    its lose_at-th result, and it never comes back."""
    from twinplane.controlplane.block_manager import BlockManager
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
    from twinplane.proto import dataplane_pb2 as dp

    core = EngineCore(ControlPlaneConfig(dataplane="unix:///a,unix:///b"), frontend)
    for replica, lose in zip(core.replicas, (lose_at, None)):
        replica.dataplane = ScriptedStream(replica, lose)
        replica.describe = dp.DescribeResponse(max_model_len=64, eos_token_ids=[2], num_kv_blocks=16, block_size=4)
        replica.scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                                      BlockManager(16, 4, True))
        replica.connected = True
    core.replicas[0]._connect = asyncio.Event().wait  # gone for good
    return core


class TokensSeen:
    """Stands in for the frontend: the (sequence, position) of every token the core sends it."""

    def __init__(self):
        self.positions: list[tuple[int, int]] = []

    def send(self, message) -> None:
        from twinplane.controlplane.messages import StepOutputs

        if isinstance(message, StepOutputs):
            self.positions += [(out.seq_id, out.position) for out in message.outputs]


class RefusalsSeen(TokensSeen):
    """Also keeps the (sequence, reason) of each request the core refuses."""

    def __init__(self):
        super().__init__()
        self.refused: list[tuple[int, str]] = []

    def send(self, message) -> None:
        from twinplane.controlplane.messages import Refused

        if isinstance(message, Refused):
            self.refused += message.reasons


def test_tokens_applied_as_a_stream_ends_go_out_before_their_sequence_moves():
    """A result read just as its data plane's stream ended (the stream found ended at the top of the step
    loop, not by the read failing) has its tokens sent before the sequence is recomputed elsewhere: the
    frontend sees every position once, in order."""
    async def run():
        frontend = TokensSeen()
        core = _core_of_two(frontend, lose_at=3)
        core.add(AddRequest(7, "r7", [5, 6, 7], RequestParams(max_tokens=8)))
        first = core.replica_of[7].index
        loops = [asyncio.create_task(r._step_loop()) for r in core.replicas]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(frontend.positions) >= 8:
                break
        for loop in loops:
            loop.cancel()
        return first, frontend.positions, core.replicas[0]

    first, positions, lost = asyncio.run(run())
    assert first == 0 and positions == [(7, p) for p in range(3, 11)] and not lost._deferred
    assert lost.scheduler.block_manager.num_free_blocks == 16  # its KV cache is gone: nothing counts as used


def test_the_frontend_hears_where_a_lost_data_plane_s_requests_went():
    """Once every data plane is lost, the requests they ran count as waiting and no block as used, in the
    snapshot the frontend gets at once (its gauges: /metrics, GetStats)."""
    from twinplane.controlplane.messages import Snapshot

    class Snapshots(TokensSeen):
        def send(self, message) -> None:
            self.last = message.snapshot if isinstance(message, Snapshot) else getattr(self, "last", None)

    async def run():
        frontend = Snapshots()
        core = _core_of_two(frontend)
        for seq_id in (1, 2, 3):
            core.add(AddRequest(seq_id, f"r{seq_id}", [5, 6, 7, 8, 9], RequestParams(max_tokens=4)))
        for replica in core.replicas:
            replica.scheduler.schedule()  # running, with blocks
            replica.connected = False
            core.recompute(replica, replica.scheduler.evict_all())
        return frontend.last

    snapshot = asyncio.run(run())
    assert (snapshot.running, snapshot.waiting) == (0, 3)
    assert all((dp.free_kv_blocks, dp.num_kv_blocks) == (0, 0) for dp in snapshot.dataplanes), snapshot.dataplanes
    assert (snapshot.free_kv_blocks, snapshot.num_kv_blocks) == (0, 0)  # no KV cache: none free, none used


def test_a_request_only_a_lost_data_plane_can_hold_waits_for_it():
    """Prompt + max_tokens past the connected data plane's max_model_len but within the lost one's (a request
    that ran there, or came while only it was connected): it waits for that one, as with none connected, and
    runs there once it is back; past both, it is refused."""
    async def run():
        frontend = RefusalsSeen()
        core = _core_of_two(frontend)
        big, small = core.replicas
        big.describe.max_model_len, small.describe.max_model_len = 64, 16
        big.connected = False
        core.add(AddRequest(1, "r1", [5] * 10, RequestParams(max_tokens=20)))  # 30 tokens: only big's
        core.add(AddRequest(2, "r2", [5] * 10, RequestParams(max_tokens=60)))  # 70: neither's
        waiting = [s.seq_id for s in core.unrouted]
        big.connected = True
        core.connections_changed(True)
        return waiting, frontend.refused, core.replica_of[1].index, list(core.unrouted)

    waiting, refused, placed, still = asyncio.run(run())
    assert waiting == [1] and [seq_id for seq_id, _ in refused] == [2] and "max_model_len" in refused[0][1]
    assert placed == 0 and still == []


def test_max_tokens_left_unset_is_lowered_only_when_no_data_plane_can_hold_it():
    """A request that left max_tokens unset (as many as fit) and no longer fits where it ran: while a data
    plane that could hold it is coming back, it waits for that one as it is; once none could, it is lowered
    to the most any connected one holds and runs there."""
    async def run():
        frontend = RefusalsSeen()
        core = _core_of_two(frontend)
        first, second = core.replicas
        first.describe.num_kv_blocks = 6  # 24 tokens; the second holds 64
        params = RequestParams(max_tokens=54, max_tokens_unset=True)  # what fitted a 64-token data plane
        second.connected = False  # coming back
        core.add(AddRequest(1, "r1", [5] * 10, params))
        waited = [(s.seq_id, s.params.max_tokens) for s in core.unrouted]
        second.describe = None  # gone for good: only the 24-token one is left, back with 32
        first.describe.num_kv_blocks = 8
        core._route(core.unrouted.popleft())
        on_first = (core.replica_of[1].index, core.seqs[1].params.max_tokens)
        second.describe, second.connected = _desc(num_kv_blocks=10), True  # a 40-token one joins
        core.add(AddRequest(2, "r2", [5] * 10, params))  # neither holds 64 tokens: the most either does
        return waited, on_first, (core.replica_of[2].index, core.seqs[2].params.max_tokens), frontend.refused

    waited, on_first, on_second, refused = asyncio.run(run())
    assert waited == [(1, 54)]  # not lowered while a data plane that holds it may come back
    assert on_first == (0, 32 - 10)  # the most the one left holds
    assert on_second == (1, 40 - 10) and refused == []


def test_a_recomputed_request_with_as_many_outputs_as_now_fit_is_refused_not_lowered():
    """Lowering an unset max_tokens leaves room for at least one more token: a request that already has every
    output the data planes left can hold is refused (it would run past their length), one short of it runs."""
    async def run(num_outputs: int):
        frontend = RefusalsSeen()
        core = _core_of_two(frontend)
        first, second = core.replicas
        first.describe.num_kv_blocks = 8  # 32 tokens: 22 outputs after a 10-token prompt
        second.describe, second.connected = None, False  # gone for good
        params = RequestParams(max_tokens=54, max_tokens_unset=True)
        core.add(AddRequest(1, "r1", [5] * 10, params, output_ids=[6] * num_outputs))
        seq = core.seqs.get(1)
        return [seq_id for seq_id, _ in frontend.refused], seq and seq.params.max_tokens

    assert asyncio.run(run(21)) == ([], 22)
    assert asyncio.run(run(22)) == ([1], None)


def test_the_frontend_checks_requests_against_the_smallest_data_plane():
    """What every connected data plane holds: the shortest max_model_len, the fewest KV tokens, the fewest
    log-probabilities (a request the frontend takes then fits wherever it is routed), the smallest step."""
    from twinplane.controlplane.engine_core import common_describe

    common = common_describe([_desc(num_kv_blocks=16, max_logprobs=20, max_num_seqs=8, max_num_batched_tokens=64),
                              _desc(num_kv_blocks=8, max_model_len=48, max_logprobs=5, max_num_seqs=16,
                                    max_num_batched_tokens=32)])
    assert (common.num_kv_blocks, common.max_model_len, common.max_logprobs) == (8, 48, 5)
    assert (common.max_num_seqs, common.max_num_batched_tokens) == (8, 32)  # ModelInfo's step limits


def _desc(**fields):
    from twinplane.proto import dataplane_pb2 as dp

    model = dict(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, head_dim=8, dtype="bfloat16", layer_params=1000, eos_token_ids=[2],
                 block_size=4, max_model_len=64, num_kv_blocks=16, kv_cache_dtype="bfloat16")
    return dp.DescribeResponse(**{**model, **fields})


def test_a_data_plane_of_another_model_or_one_driven_already_is_not_taken():
    """Checked against the data planes the other replicas have taken, connected or still connecting (as at
    start-up, when they all connect at once)."""
    async def run():
        core = _core_of_two(TokensSeen())
        first, second = core.replicas
        first.connected = second.connected = False
        assert first._refusal(_desc(instance_id="a")) is None  # taken: claimed before its stream is open
        return {what: core.refusal(second, desc) for what, desc in [
            ("same model", _desc(instance_id="b", max_model_len=32, num_kv_blocks=8, model="/elsewhere",
                                 layer_params=2000, tensor_parallel_size=2)),
            ("not told", _desc()), ("the same one", _desc(instance_id="a")),
            ("other shapes", _desc(instance_id="b", hidden_size=64, eos_token_ids=[2, 3])),
            ("other dtype", _desc(instance_id="b", dtype="float16")),
            ("other KV dtype", _desc(instance_id="b", kv_cache_dtype="float8_e4m3fn", kv_bytes_per_token=64)),
            ("other blocks", _desc(instance_id="b", block_size=16)),
            ("other defaults", _desc(instance_id="b", generation_config={"temperature": 0.6}))]}, \
            core.refusal(first, _desc(hidden_size=64))

    why, alone = asyncio.run(run())
    assert why["same model"] is None and why["not told"] is None and alone is None  # no other one taken
    assert "data plane 0 (unix:///a) drives already" in why["the same one"]
    assert "hidden_size 64 (the others: 32); eos_token_ids [2, 3] (the others: [2])" in why["other shapes"]
    assert "dtype 'float16' (the others: 'bfloat16')" in why["other dtype"]
    assert "kv_cache_dtype 'float8_e4m3fn' (the others: 'bfloat16')" in why["other KV dtype"]
    assert "block_size 16 (the others: 4)" in why["other blocks"]
    assert "generation_config {'temperature': 0.6} (the others: {})" in why["other defaults"]  # the frontends' defaults


def test_requests_that_waited_for_a_data_plane_not_taken_again_are_refused():
    """A lost data plane comes back with another model: the request that only it could hold (it waited for
    it) is refused with the reason, not left waiting."""
    from twinplane.controlplane.dataplane_client import DataPlaneLost
    class Declined:
        async def connect(self, timeout=None, refusal=lambda desc: None):
            raise DataPlaneLost(refusal(_desc(instance_id="z", hidden_size=99)), declined=True)

    async def run():
        frontend = RefusalsSeen()
        core = _core_of_two(frontend)
        small, big = core.replicas
        small.claimed, small.describe.max_model_len, big.describe.max_model_len = _desc(), 16, 64
        big.connected = False
        core.add(AddRequest(1, "r1", [5] * 10, RequestParams(max_tokens=20)))
        waited = [s.seq_id for s in core.unrouted]
        big.dataplane = Declined()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(big._connect(), 0.2)
        return waited, frontend.refused, big.describe

    waited, refused, describe = asyncio.run(run())
    assert waited == [1] and [seq_id for seq_id, _ in refused] == [1] and describe is None


def test_an_address_given_twice_is_refused():
    from twinplane.controlplane.config import ControlPlaneConfig

    with pytest.raises(ValueError, match="unix:///a given more than once"):
        ControlPlaneConfig(dataplane="unix:///a,unix:///b, unix:///a")


def test_new_requests_go_to_a_data_plane_that_answers():
    """While one data plane counts as stalled, new requests go to the others; with every one stalled, they
    are routed as before."""
    async def run():
        core = _core_of_two(TokensSeen())
        core.replicas[0].stalled = True
        for seq_id in (1, 2, 3):
            core.add(AddRequest(seq_id, f"r{seq_id}", [5, 6, 7], RequestParams(max_tokens=4)))
        core.replicas[1].stalled = True
        core.add(AddRequest(4, "r4", [5, 6, 7], RequestParams(max_tokens=4)))
        return {seq_id: replica.index for seq_id, replica in core.replica_of.items()}

    placed = asyncio.run(run())
    assert [placed[i] for i in (1, 2, 3)] == [1, 1, 1] and placed[4] == 0  # the less loaded


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
            if process is not None:
                stop_process(process)


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


def test_one_data_plane_reached_by_two_addresses_is_driven_by_one_replica(tiny_qwen3_dir, tmp_path_factory,
                                                                          shared_planes, capfd):
    """The second address (a link to the first's socket) finds the data plane another replica drives, by its
    instance id, and leaves it alone: no replica takes the Step stream from the other, outputs are as with
    one address."""
    folder = tmp_path_factory.mktemp("twice")
    planes = Planes(folder, tiny_qwen3_dir, DATAPLANE_ARGS)
    (folder / "link.sock").symlink_to(folder / "dp.sock")
    planes.config = replace(planes.config, dataplane=f"{planes.dp_address},unix://{folder}/link.sock")
    prompts = random_prompts(6, seed=506, low=10, high=60)
    expected = asyncio.run(greedy_references(shared_planes.address, prompts, 16))
    log = StderrLog(capfd)
    try:
        planes.start()
        log.wait_for("drives already")
        assert asyncio.run(greedy_references(planes.address, prompts, 16)) == expected
        seen = [[d["connected"] for d in _stats(planes)["dataplanes"]] for _ in range(5)]
        assert sorted(seen[0]) == [False, True] and all(s == seen[0] for s in seen), seen
        assert "recomputing" not in log and " lost (" not in log, log.text  # no replica lost its stream
    finally:
        planes.stop()


def test_a_data_plane_with_another_block_size_is_not_taken(tiny_qwen3_dir, tmp_path_factory, capfd):
    planes = DataParallelPlanes(tmp_path_factory.mktemp("mixed"), tiny_qwen3_dir, DATAPLANE_ARGS)
    log = StderrLog(capfd)
    try:
        planes.start_controlplane()
        planes.start_dataplane(0)
        planes.wait_ready()
        planes.dp_command[planes.dp_command.index("--block-size") + 1] = "32"
        planes.start_dataplane(1)
        # bounds a data plane's start-up (torch's imports, the model's load): 15 s here with the CPU busy, so the
        # 120 s that Planes.start allows it
        log.wait_for("is not taken", timeout=120)
        assert "block_size 32 (the others: 16)" in log
        asyncio.run(greedy_references(planes.address, random_prompts(4, seed=507, low=10, high=30), 4))
        stats = _stats(planes)
        assert [d["connected"] for d in stats["dataplanes"]] == [True, False]
        assert stats["dataplanes"][0]["steps"] > 0 and stats["dataplanes"][1]["steps"] == 0
    finally:
        planes.stop()
