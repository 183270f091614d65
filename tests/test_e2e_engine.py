"""Engine behaviour through both planes: batching, prefix cache, preemption, sampling, stops, cancel."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.reliability import wait_until
from tests.test_e2e_reference import random_prompts


def tokens_of(stream) -> list[int]:
    return [t for c in stream for t in c.token_ids]


def run_concurrently(client, prompts, **kwargs) -> list[list[int]]:
    results: list[list[int] | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = tokens_of(client.generate(token_ids=prompts[i], **kwargs))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.fixture(scope="module")
def qwen3_planes(tiny_qwen3_dir, tmp_path_factory):
    from tests.conftest import Planes

    planes = Planes(tmp_path_factory.mktemp("qwen3"), tiny_qwen3_dir, ("--block-size", "16")).start()
    yield planes
    planes.stop()


GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


def test_batch_invariance_16_mixed_prompts(qwen3_planes):
    prompts = random_prompts(16, seed=11, low=1, high=300)
    with qwen3_planes.client() as client:
        alone = [tokens_of(client.generate(token_ids=p, **GREEDY)) for p in prompts]
        together = run_concurrently(client, prompts, **GREEDY)
    assert together == alone
    assert qwen3_planes.free_blocks()[0] == qwen3_planes.free_blocks()[1]


def test_prefix_cache_reports_cached_tokens_and_same_output(qwen3_planes):
    prompt = random_prompts(1, seed=5, low=100, high=100)[0]
    with qwen3_planes.client() as client:
        first = list(client.generate(token_ids=prompt, **GREEDY))
        second = list(client.generate(token_ids=prompt, **GREEDY))
    assert first[-1].usage.cached_prompt_tokens == 0
    assert second[-1].usage.cached_prompt_tokens == 96  # six full blocks of 16; the last token is recomputed
    assert tokens_of(first) == tokens_of(second)


def test_seeded_sampling_is_reproducible(qwen3_planes):
    prompt = random_prompts(1, seed=3)[0]
    kwargs = dict(token_ids=prompt, max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True)
    with qwen3_planes.client() as client:
        a = tokens_of(client.generate(seed=1234, **kwargs))
        b = tokens_of(client.generate(seed=1234, **kwargs))
        others = run_concurrently(client, [prompt] * 4, seed=1234, **{k: v for k, v in kwargs.items()
                                                                      if k != "token_ids"})
        c = tokens_of(client.generate(seed=99, **kwargs))
    assert a == b and all(o == a for o in others)
    assert c != a


def test_max_and_min_tokens(qwen3_planes):
    prompt = random_prompts(1, seed=8)[0]
    with qwen3_planes.client() as client:
        chunks = list(client.generate(token_ids=prompt, max_tokens=5, temperature=0))
        assert len(tokens_of(chunks)) <= 5
        assert chunks[-1].finish_reason in ("length", "stop_token")
        # the most likely first token, made a stop token: with min_tokens it cannot end the request early
        first = tokens_of(client.generate(token_ids=prompt, max_tokens=1, temperature=0))[0]
        stopped = list(client.generate(token_ids=prompt, max_tokens=8, temperature=0, stop_token_ids=[first]))
        assert tokens_of(stopped) == [first] and stopped[-1].finish_reason == "stop_token"
        held = list(client.generate(token_ids=prompt, max_tokens=8, min_tokens=4, temperature=0,
                                    stop_token_ids=[first]))
        out = tokens_of(held)
        assert len(out) >= 4 and first not in out[:4]


def test_stop_string_ends_and_is_never_emitted(smollm2_dir, planes_factory):
    from tests.reliability import all_blocks_free, wait_until

    planes = planes_factory(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with planes.client() as client:
        full = "".join(c.text for c in client.generate(messages=messages, max_tokens=24, temperature=0))
        assert "Paris" in full
        computed_before = planes.engine.core_snapshot.stats["computed_tokens"]
        chunks = list(client.generate(messages=messages, max_tokens=400, temperature=0, stop=["Paris"]))
        kept = list(client.generate(messages=messages, max_tokens=400, temperature=0, stop=["Paris"],
                                    include_stop_str_in_output=True))
    assert "".join(c.text for c in kept) == full[:full.index("Paris") + len("Paris")]  # asked to keep it
    assert kept[-1].finish_reason == "stop_string" and kept[-1].matched_stop == "Paris"
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop_string" and chunks[-1].matched_stop == "Paris"
    assert text == full[:full.index("Paris")]
    assert all("Par" not in c.text for c in chunks)
    # the frontend found the stop string; the engine core stopped the sequence and freed its blocks
    wait_until(lambda: all_blocks_free(planes), 5, "every KV block to be free")
    assert planes.engine.core_snapshot.stats["computed_tokens"] - computed_before < 150


def test_scheduling_by_priority_admits_the_lowest_value_first(tiny_qwen3_dir, planes_factory):
    """One sequence at a time: while a long request runs, a request of priority 5 and then one of
    priority -5 wait; the second is admitted first. Without the policy a priority is refused."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", scheduling_policy="priority", max_num_seqs=1)
    first_token: dict[str, float] = {}

    def run(name: str, max_tokens: int, priority: int) -> None:
        for _ in client.generate(token_ids=[5, 6, 7, 8], max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                 priority=priority):
            first_token.setdefault(name, time.perf_counter())

    with planes.client() as client:
        long = threading.Thread(target=run, args=("long", 1500, 0))
        long.start()
        wait_until(lambda: "long" in first_token, 30, "the long request's first token")
        # the urgent one's 32 tokens all come before the late one's first: the order of first tokens stands out
        # from any delay of the threads that read them
        waiting = [threading.Thread(target=run, args=(name, 32, priority)) for name, priority in (("late", 5),
                                                                                                  ("urgent", -5))]
        for thread in waiting:
            thread.start()
            wait_until(lambda: len(planes.engine.requests) > waiting.index(thread) + 1, 10, "the request queued")
        assert long.is_alive(), "the long request ended before the others queued: the test proves nothing"
        for thread in (long, *waiting):
            thread.join(120)
    assert first_token["long"] < first_token["urgent"] < first_token["late"]
    fcfs = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    with fcfs.client() as client, pytest.raises(grpc.RpcError) as error:
        client.generate_text(token_ids=[5, 6], max_tokens=2, priority=1)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--scheduling-policy priority" in (
        error.value.details())


def test_cancelled_stream_frees_its_blocks(qwen3_planes):
    prompt = random_prompts(1, seed=9, low=200, high=200)[0]
    with qwen3_planes.client() as client:
        stream = client.generate(token_ids=prompt, max_tokens=2000, temperature=0, ignore_eos=True)
        it = iter(stream)
        next(it)
        assert qwen3_planes.free_blocks()[0] < qwen3_planes.free_blocks()[1]
        stream.cancel()
    deadline = time.time() + 10
    while time.time() < deadline and qwen3_planes.free_blocks()[0] != qwen3_planes.free_blocks()[1]:
        time.sleep(0.05)
    free, total = qwen3_planes.free_blocks()
    assert free == total
    assert not qwen3_planes.engine.requests


@pytest.mark.parametrize("max_steps_in_flight", [2, 3])
def test_preemption_gives_same_outputs_and_frees_every_block(tiny_qwen3_dir, qwen3_planes, planes_factory,
                                                             max_steps_in_flight):
    """Also with three steps in flight, where a preempted sequence may wait for a token of a
    step still running before it can be admitted again."""
    prompts = random_prompts(8, seed=21, low=20, high=60)
    kwargs = dict(max_tokens=40, temperature=0, ignore_eos=True)
    with qwen3_planes.client() as client:
        expected = [tokens_of(client.generate(token_ids=p, **kwargs)) for p in prompts]
    # each request needs at most 100 tokens = 25 blocks of 4; 28 blocks hold one, not eight
    small = planes_factory(tiny_qwen3_dir, "--block-size", "4", "--num-kv-blocks", "28",
                           max_steps_in_flight=max_steps_in_flight)
    with small.client() as client:
        got = run_concurrently(client, prompts, **kwargs)
    assert got == expected
    assert small.engine.core_snapshot.num_preemptions > 0
    free, total = small.free_blocks()
    assert free == total


def test_penalties_see_the_prefix_served_from_the_cache(qwen3_planes):
    prompt = random_prompts(1, seed=31, low=70, high=70)[0]
    kwargs = dict(token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True,
                  repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.5)
    with qwen3_planes.client() as client:
        first = list(client.generate(**kwargs))
        second = list(client.generate(**kwargs))
    assert second[-1].usage.cached_prompt_tokens == 64
    assert tokens_of(first) == tokens_of(second)


def test_stream_interval_batches_tokens_per_message(tiny_qwen3_dir, planes_factory):
    # one decode step per plan: a plan of several would bring several tokens a step
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", stream_interval=3, decode_steps=1)
    prompt = random_prompts(1, seed=41)[0]
    with planes.client() as client:
        chunks = list(client.generate(token_ids=prompt, max_tokens=10, temperature=0, ignore_eos=True))
    # the first token goes out at once, then three a message: [1, 3, 3, 3], unless a loaded machine kept the
    # client from reading while messages queued, which then go out merged (Engine.outputs)
    sizes = [len(c.token_ids) for c in chunks]
    assert sum(sizes) == 10 and sizes[0] % 3 == 1 and all(size % 3 == 0 for size in sizes[1:]), sizes
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10


def test_a_long_prompts_logprobs_come_in_one_message(tmp_path, planes_factory):
    """A 24,000-token prompt's log-probabilities with their top 20 tokens: one first message of over 4 MiB
    (gRPC's default receive limit, which the Python client raises), every position in it."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=24576, architectures=["Qwen3ForCausalLM"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    planes = planes_factory(str(tmp_path), "--block-size", "16", "--max-model-len", "24576",
                            "--max-num-batched-tokens", "2048")
    prompt = [(i * 7919) % 1024 for i in range(24_000)]
    with planes.client() as client:
        first = next(iter(client.generate(token_ids=prompt, max_tokens=1, prompt_logprobs=20)))
    assert [p.token_id for p in first.prompt_logprobs] == prompt[1:]
    assert all(len(p.top) == 20 and p.top[0][1] >= p.logprob for p in first.prompt_logprobs)


def test_a_request_without_max_tokens_gets_what_fits_in_a_kv_cache_smaller_than_max_model_len(
        tiny_qwen3_dir, planes_factory):
    """Without max_tokens a request generates as many tokens as fit: in max_model_len, and in the whole KV
    cache when that holds fewer (here 8 blocks of 16 tokens against a max_model_len of 4,096)."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--num-kv-blocks", "8")
    assert planes.engine.limits.max_model_len > 8 * 16
    with planes.client() as client:
        chunks = list(client.generate(token_ids=list(range(10, 20)), temperature=0, ignore_eos=True))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8 * 16 - 10
