"""Data-plane faults lose nothing: a killed data plane costs KV cache, never tokens or requests.

While the data plane is gone the control plane says NOT_SERVING and new requests wait
(up to their deadline); when one is back it resets its BlockManager and re-prefills
every running sequence, so each stream ends exactly as an undisturbed run would.
A data plane that fails one step fails only the requests of that step (INTERNAL).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.faulty_dataplane import PAUSE_MARK, PAUSE_TOKEN, POISON_TOKEN
from tests.reliability import GREEDY, all_blocks_free, greedy_references, status_code, tokens_async, wait_until
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient, Client

NUM_STREAMS, MAX_TOKENS = 32, 120
SERVING = health_pb2.HealthCheckResponse.SERVING


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status


async def _streams_across_a_crash(planes, prompts: list[list[int]]) -> dict:
    """Runs the streams; kills the data plane once each has tokens; checks the outage; restarts it."""
    seen = [0] * len(prompts)
    report = {}

    async def one(client: AsyncClient, i: int) -> list[int]:
        out = []
        async for chunk in client.generate(token_ids=prompts[i], max_tokens=MAX_TOKENS, **GREEDY):
            out += chunk.token_ids
            seen[i] = len(out)
        return out

    async with AsyncClient(planes.address) as client, grpc.aio.insecure_channel(planes.address) as channel:
        streams = [asyncio.ensure_future(one(client, i)) for i in range(len(prompts))]
        while min(seen) < 5:
            await asyncio.sleep(0.005)
        planes.dataplane.send_signal(signal.SIGKILL)
        await asyncio.to_thread(planes.dataplane.wait, 10)
        await asyncio.to_thread(wait_until, lambda: not planes.engine.ready.is_set(), 10, "the loss to be noticed")
        await asyncio.sleep(0.5)  # tokens that were on their way when it died reach their streams
        report["seen_at_kill"] = list(seen)
        report["health_during_outage"] = await _health(channel)
        # a new request waits for the data plane instead of failing; one with a short deadline expires waiting
        waiter = asyncio.ensure_future(tokens_async(client, [9] * 12, max_tokens=6, timeout=120, **GREEDY))
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tokens_async(client, [9] * 12, max_tokens=6, timeout=1.0, **GREEDY)
        report["short_deadline"] = (info.value.code(), time.monotonic() - started)
        report["progress_during_outage"] = list(seen) == report["seen_at_kill"]
        await asyncio.to_thread(planes.start_dataplane)
        report["outputs"] = list(await asyncio.gather(*streams))
        report["waiter"] = await waiter
        report["health_after"] = await _health(channel)
    return report


def test_sigkill_during_32_streams_loses_no_token(tiny_qwen3_dir, planes_factory):
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-model-len", "512")
    prompts = random_prompts(NUM_STREAMS, seed=404, low=10, high=80)
    expected = asyncio.run(greedy_references(planes.address, prompts, MAX_TOKENS))
    report = asyncio.run(_streams_across_a_crash(planes, prompts))
    assert max(report["seen_at_kill"]) < MAX_TOKENS  # every stream was cut mid-way
    assert report["health_during_outage"] != SERVING
    assert report["short_deadline"][0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert report["short_deadline"][1] >= 0.9  # it waited for its deadline, it was not refused
    assert report["progress_during_outage"]
    assert report["outputs"] == expected  # no token lost, none repeated
    assert len(report["waiter"]) == 6
    assert report["health_after"] == SERVING
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")


def _child_pids(pid: int) -> list[int]:
    """The data-plane children of pid (the control plane's engine core is a child too)."""
    psutil = pytest.importorskip("psutil")
    return [c.pid for c in psutil.Process(pid).children() if "dataplane" in c.cmdline()]


def test_twinplane_serve_restarts_its_data_plane(tmp_path):
    cp, dp = f"unix://{tmp_path}/cp.sock", f"unix://{tmp_path}/dp.sock"
    serve = subprocess.Popen([sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING", "serve",
                              "--model", "dummy:tiny-qwen3", "--device", "cpu", "--block-size", "16",
                              "--max-model-len", "512", "--listen", cp, "--dataplane-listen", dp],
                             stdin=subprocess.DEVNULL)
    try:
        with Client(cp) as client:
            client.wait_ready(timeout=120)
            children = _child_pids(serve.pid)
            assert len(children) == 1
            prompts = random_prompts(8, seed=405, low=10, high=40)
            expected = asyncio.run(greedy_references(cp, prompts, MAX_TOKENS))

            async def crash() -> list[list[int]]:
                async with AsyncClient(cp) as aclient:
                    streams = [aclient.generate(token_ids=p, max_tokens=MAX_TOKENS, **GREEDY).__aiter__()
                               for p in prompts]
                    firsts = [await s.__anext__() for s in streams]  # every stream is running
                    os.kill(children[0], signal.SIGKILL)
                    rests = await asyncio.gather(*(_rest(s) for s in streams))
                    return [f.token_ids + r for f, r in zip(firsts, rests)]

            assert asyncio.run(crash()) == expected
            new_children = _child_pids(serve.pid)
            assert len(new_children) == 1 and new_children != children
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        wait_until(lambda: not Path(dp.removeprefix("unix://")).exists() or _gone(new_children[0]), 10,
                   "the data plane child to exit")
    finally:
        if serve.poll() is None:
            serve.kill()


async def _rest(chunks) -> list[int]:
    return [t async for chunk in chunks for t in chunk.token_ids]


def _gone(pid: int) -> bool:
    psutil = pytest.importorskip("psutil")
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def faulty(tiny_qwen3_dir, tmp_path_factory):
    from tests.conftest import Planes

    script = Path(__file__).with_name("faulty_dataplane.py")
    planes = Planes(tmp_path_factory.mktemp("faulty"), tiny_qwen3_dir,
                    ("--block-size", "16", "--max-model-len", "512", "--max-num-seqs", "1"),
                    dp_program=(str(script),)).start()
    yield planes
    planes.stop()


def test_a_failed_step_fails_only_its_requests(faulty):
    prompts = random_prompts(3, seed=406, low=10, high=40)
    expected = asyncio.run(greedy_references(faulty.address, prompts, 20))

    async def run() -> list:
        async with AsyncClient(faulty.address) as client:  # one sequence per step: the poisoned one is alone
            poisoned = asyncio.ensure_future(tokens_async(client, [POISON_TOKEN, 5, 6, 7], max_tokens=20, **GREEDY))
            others = [asyncio.ensure_future(tokens_async(client, p, max_tokens=20, **GREEDY)) for p in prompts]
            return list(await asyncio.gather(poisoned, *others, return_exceptions=True))

    poisoned, *others = asyncio.run(run())
    assert isinstance(poisoned, grpc.aio.AioRpcError) and poisoned.code() == grpc.StatusCode.INTERNAL
    assert "injected fault" in poisoned.details()
    assert others == expected
    wait_until(lambda: all_blocks_free(faulty), 10, "every KV block to be free")
    with faulty.client() as client:  # the data plane and the control plane keep serving
        assert len([t for c in client.generate(token_ids=[5, 6, 7], max_tokens=5, **GREEDY) for t in c.token_ids]) == 5


def test_a_step_sent_before_a_failure_was_known_recomputes_its_requests(tiny_qwen3_dir, planes_factory, tmp_path,
                                                                        monkeypatch):
    """The step loop plans ahead: the step after a failed one was sent before the failure came back,
    and it continues the prompt that failed, which the data plane undid, so it fails too. A request
    it admitted did nothing wrong: it starts over and ends as an undisturbed run would."""
    script, mark = Path(__file__).with_name("faulty_dataplane.py"), tmp_path / "paused"
    monkeypatch.setenv(PAUSE_MARK, str(mark))  # the data plane's environment
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-model-len", "512", dp_program=(str(script),),
                            max_num_batched_tokens=32)
    innocent = random_prompts(1, seed=408, low=12, high=16)[0]
    expected = asyncio.run(greedy_references(planes.address, [innocent], 12))[0]
    poison = [POISON_TOKEN, *random_prompts(1, seed=409, low=39, high=40)[0]]  # 40 tokens: two steps of 32

    async def until(done, what: str) -> None:
        for _ in range(500):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}")

    async def run() -> list:
        async with AsyncClient(planes.address) as client:
            pause = asyncio.ensure_future(tokens_async(client, [PAUSE_TOKEN, 5, 6], max_tokens=1, **GREEDY))
            await until(mark.exists, "the data plane to pause")  # on that prompt's step: the next two queue up
            poisoned = asyncio.ensure_future(tokens_async(client, poison, max_tokens=5, **GREEDY))
            await until(lambda: len(planes.engine.requests) == 2, "the poisoned request to reach the core")
            after = asyncio.ensure_future(tokens_async(client, innocent, max_tokens=12, **GREEDY))
            return list(await asyncio.wait_for(asyncio.gather(pause, poisoned, after, return_exceptions=True), 60))

    paused, poisoned, after = asyncio.run(run())
    assert len(paused) == 1
    assert isinstance(poisoned, grpc.aio.AioRpcError) and "injected fault" in poisoned.details()
    assert after == expected  # not failed with the step after the poisoned one, which the data plane refused
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")


def test_a_failed_step_whose_masks_were_to_follow_fails_only_its_requests(tiny_qwen3_dir, planes_factory):
    """Structured output decodes in plans whose masks follow them. A poisoned prompt that joins such a plan
    fails it at launch; the masks the core then sends for it are dropped, the requests of that step fail,
    and the stream stays in step: every request ends, and the next ones run."""
    script = Path(__file__).with_name("faulty_dataplane.py")
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-model-len", "512", dp_program=(str(script),))
    regex = "[a-z ]{1,60}"

    async def text(client, token_ids: list[int]) -> str:
        chunks = client.generate(token_ids=token_ids, max_tokens=40, regex=regex, timeout=120,
                                 **GREEDY)
        return "".join([chunk.text async for chunk in chunks])

    async def run() -> list:
        async with AsyncClient(planes.address) as client:
            structured = [asyncio.ensure_future(text(client, p)) for p in random_prompts(3, seed=407, low=10, high=30)]
            await asyncio.sleep(0.3)  # they decode, planned ahead with their masks following
            poisoned = asyncio.ensure_future(tokens_async(client, [POISON_TOKEN, 5, 6], max_tokens=5, **GREEDY))
            return list(await asyncio.wait_for(asyncio.gather(poisoned, *structured, return_exceptions=True), 120))

    poisoned, *structured = asyncio.run(run())
    assert isinstance(poisoned, grpc.aio.AioRpcError) and "injected fault" in poisoned.details()
    for out in structured:
        assert (isinstance(out, grpc.aio.AioRpcError) and out.code() == grpc.StatusCode.INTERNAL) or \
            re.fullmatch(regex, out), out
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")
    with planes.client() as client:  # the next structured requests run
        for _ in range(2):
            out = "".join(c.text for c in client.generate(token_ids=[5, 6, 7], max_tokens=12, regex=regex, **GREEDY))
            assert re.fullmatch(regex, out), out


async def _across_a_restart(planes, requests: list[tuple[list[int], int]], dataplane_args: tuple[str, ...]) -> list:
    """Starts the streams; once each has its first tokens, replaces the data plane by one started with
    dataplane_args; returns each stream's tokens, or the error that ended it."""
    async with AsyncClient(planes.address) as client:
        streams = [client.generate(token_ids=p, max_tokens=n, **GREEDY).__aiter__() for p, n in requests]
        firsts = [await s.__anext__() for s in streams]
        planes.dataplane.send_signal(signal.SIGKILL)
        await asyncio.to_thread(planes.dataplane.wait, 10)
        planes.dp_command = [*planes.dp_command, *dataplane_args]  # later flags win
        await asyncio.to_thread(planes.start_dataplane)
        rests = await asyncio.gather(*(_rest(s) for s in streams), return_exceptions=True)
    return [r if isinstance(r, Exception) else f.token_ids + r for f, r in zip(firsts, rests)]


def test_a_smaller_data_plane_ends_only_the_requests_it_can_never_hold(tiny_qwen3_dir, planes_factory):
    """A data plane may come back with fewer KV blocks (measured from free memory) or a shorter
    max_model_len: requests that can never fit end with FAILED_PRECONDITION instead of blocking
    the queue, and the others finish exactly as an undisturbed run would; one that left max_tokens
    unset (as many as fit) gets fewer."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-model-len", "512", "--num-kv-blocks", "64")
    keep = random_prompts(2, seed=407, low=10, high=11)
    expected = asyncio.run(greedy_references(planes.address, keep, MAX_TOKENS))
    big = [7] * 10

    # 1. 24 blocks of 16 tokens: 384 tokens; the 10 + 400 tokens of the big request no longer fit
    outputs = asyncio.run(_across_a_restart(planes, [(big, 400), *((p, MAX_TOKENS) for p in keep)],
                                            ("--num-kv-blocks", "24")))
    refused, *kept = outputs
    assert status_code(refused) == grpc.StatusCode.FAILED_PRECONDITION, refused
    assert "no longer fits in the data plane's KV cache (384 tokens)" in refused.details()
    assert kept == expected
    with planes.client() as client:  # health is back, and the frontend checks new requests against the new cache
        client.wait_ready(timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(token_ids=big, max_tokens=400, **GREEDY))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # 2. max_model_len 200: 10 + 300 tokens exceed it
    outputs = asyncio.run(_across_a_restart(planes, [(big, 300), *((p, MAX_TOKENS) for p in keep)],
                                            ("--max-model-len", "200")))
    refused, *kept = outputs
    assert status_code(refused) == grpc.StatusCode.FAILED_PRECONDITION, refused
    assert "exceeds the data plane's max_model_len (200)" in refused.details()
    assert kept == expected

    # 3. max_tokens unset: what fits, 200 - 10 tokens on arrival; on 8 blocks (128 tokens), 118, not refused
    [lowered] = asyncio.run(_across_a_restart(planes, [(big, None)], ("--num-kv-blocks", "8")))
    assert isinstance(lowered, list) and len(lowered) == 128 - len(big), lowered
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")
