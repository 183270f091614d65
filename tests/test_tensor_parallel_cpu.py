"""Tensor parallelism on CPU: two or four ranks over gloo give the tokens of one.

The GPU test (tests/test_gpu.py) runs TP=2 over NCCL on two GPUs; this one runs the same code
paths everywhere: each rank loads its shard of the weights (q/k/v and gate/up split by heads
and features, o and down by rows, the vocabulary by rows), the row-parallel layers and the
embedding all-reduce, the LM head gathers on rank 0, which alone samples and broadcasts its
tokens, and rank 0 hands every plan to the worker through shared memory. Plans of several
decode steps (a few sequences) and plain steps (prompts) both run, and so do plans whose token
masks (structured output) come after them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 49_000, size=int(rng.integers(5, 60))).tolist() for _ in range(count)]


def test_ranks_on_cpu_give_the_tokens_of_one(planes_factory, tiny_qwen3_dir):
    prompts = _prompts(3)
    requests = [dict(token_ids=p, max_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
    requests.append(dict(token_ids=prompts[0], max_tokens=24, temperature=0.9, seed=7, ignore_eos=True))
    # structured output, batched with the rest: plans planned ahead send their masks after them
    structured = [dict(token_ids=prompts[1], max_tokens=24, temperature=0, ignore_eos=True, regex="[a-z ,.]+"),
                  dict(token_ids=prompts[2], max_tokens=24, temperature=0.9, seed=3, ignore_eos=True,
                       choice=["alpha beta gamma delta", "epsilon zeta eta theta iota"])]
    requests += structured

    def run(tp: int) -> list[list[int]]:
        planes = planes_factory(tiny_qwen3_dir, "--tensor-parallel-size", str(tp), "--block-size", "16",
                                "--max-model-len", "256")
        with planes.client() as client, ThreadPoolExecutor(len(requests)) as pool:  # batched together
            tokens = list(pool.map(lambda r: [t for c in client.generate(**r) for t in c.token_ids], requests))
        planes.stop()
        assert planes.dataplane.returncode == 0, "the data plane (and its worker) should stop cleanly"
        return tokens

    one = run(1)
    assert [len(t) for t in one[:-2]] == [24] * (len(requests) - 2) and len(one[-1]) < 24
    for ranks in (2, 4):  # 4: more ranks than the model's 2 KV heads, each replicated
        assert run(ranks) == one, f"{ranks} ranks"
