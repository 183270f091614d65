"""Cancellation and deadlines: an abandoned call stops its sequence and frees its blocks at once."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from tests.reliability import DRAIN_LONG, GREEDY, all_blocks_free, greedy_references, wait_until
from tests.test_e2e_reference import random_prompts
from twinplane.clients.client import AsyncClient

NUM_STREAMS, MAX_TOKENS = 200, 24


async def _kept(client: AsyncClient, i: int, prompt: list[int]) -> list[int]:
    stream = client.generate(token_ids=prompt, request_id=f"keep-{i}", max_tokens=MAX_TOKENS, **GREEDY)
    return [t async for chunk in stream for t in chunk.token_ids]


async def _cancelled(client: AsyncClient, i: int, prompt: list[int], rng: random.Random) -> None:
    """Cancels before any output (after a random pause) or after a random number of chunks."""
    stream = client.generate(token_ids=prompt, request_id=f"cancel-{i}", max_tokens=MAX_TOKENS, **GREEDY)
    after_chunks = rng.choice([0, 1, 2, 3, 5, 8])
    if after_chunks == 0:
        await asyncio.sleep(rng.uniform(0, 0.3))
    else:
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= after_chunks:
                break
    stream.cancel()


async def _chaos(address: str, prompts: list[list[int]], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    async with AsyncClient(address) as client:
        kept = [asyncio.ensure_future(_kept(client, i, p)) for i, p in enumerate(prompts) if i % 2 == 0]
        cancelled = [asyncio.ensure_future(_cancelled(client, i, p, rng)) for i, p in enumerate(prompts) if i % 2]
        await asyncio.gather(*cancelled)
        return list(await asyncio.gather(*kept))


def test_200_streams_half_cancelled_at_random_moments(shared_planes):
    prompts = random_prompts(NUM_STREAMS, seed=200, low=5, high=60)
    kept_prompts = prompts[0::2]
    expected = asyncio.run(greedy_references(shared_planes.address, kept_prompts, MAX_TOKENS))
    assert all(len(e) == MAX_TOKENS for e in expected)
    got = asyncio.run(_chaos(shared_planes.address, prompts, seed=7))
    assert got == expected
    wait_until(lambda: all_blocks_free(shared_planes), 10, "every KV block to be free")
    core = shared_planes.engine.core_snapshot  # the engine core holds no sequence any more
    assert core.running == core.waiting == 0 and core.num_added >= NUM_STREAMS


def test_cancel_frees_blocks_as_soon_as_the_server_hears_of_it(shared_planes):
    """The done callback aborts the request at once: the engine core frees its blocks long before
    the request would have ended."""
    engine = shared_planes.engine
    computed_before = engine.core_snapshot.stats["computed_tokens"]
    with shared_planes.client() as client:
        stream = client.generate(token_ids=[5] * 40, request_id="one", max_tokens=400, **GREEDY)
        next(iter(stream))
        state = shared_planes.call(_state_of(engine, "one"))
        stream.cancel()
        wait_until(lambda: all_blocks_free(shared_planes), 5, "every KV block to be free")
    core = engine.core_snapshot
    assert core.running == core.waiting == 0 and state.finished
    assert core.stats["computed_tokens"] - computed_before < 40 + 200  # stopped, far from 40 + 399


async def _state_of(engine, request_id: str):
    (state,) = [state for state in engine.requests.values() if state.request_id == request_id]
    return state


def test_deadline_exceeded_frees_blocks(drain_planes):
    """The request cannot end before its deadline on any machine (drain_planes: each token reads all the weights);
    the tiny model's 480 tokens took 0.7 s on an idle 2-core machine, under 0.3 s on one a few times as fast."""
    with drain_planes.client() as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(token_ids=[7] * 30, max_tokens=DRAIN_LONG, timeout=1.0, **GREEDY))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        wait_until(lambda: all_blocks_free(drain_planes), 5, "the expired request's blocks to be freed")
        # and the server goes on serving
        assert len([t for c in client.generate(token_ids=[7] * 30, max_tokens=4, **GREEDY) for t in c.token_ids]) == 4
