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

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest


# A data plane of N ranks starts N processes, each importing torch and loading its shard: on 2 busy cores a
# start of 4 ranks took 43 s, close to the 120 s one process gets; these starts get more.
START_TIMEOUT = 300.0


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 49_000, size=int(rng.integers(5, 60))).tolist() for _ in range(count)]


@pytest.mark.timeout(900)  # three starts (1, 2 and 4 ranks), each within its START_TIMEOUT
def test_ranks_on_cpu_give_the_tokens_of_one(planes_factory, tiny_qwen3_dir, capfd):
    prompts = _prompts(3)
    requests = [dict(token_ids=p, max_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
    requests.append(dict(token_ids=prompts[0], max_tokens=24, temperature=0.9, seed=7, ignore_eos=True))
    # structured output, batched with the rest: plans planned ahead send their masks after them
    structured = [dict(token_ids=prompts[1], max_tokens=24, temperature=0, ignore_eos=True, regex="[a-z ,.]+"),
                  dict(token_ids=prompts[2], max_tokens=24, temperature=0.9, seed=3, ignore_eos=True,
                       choice=["alpha beta gamma delta", "epsilon zeta eta theta iota"])]
    requests += structured
    # the prompt's log-probabilities: every rank joins the output projection of its positions
    requests.insert(0, dict(token_ids=prompts[2], max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2))

    def generate(client, request: dict) -> tuple[list[int], list]:
        chunks = list(client.generate(**request))
        return [t for c in chunks for t in c.token_ids], chunks[0].prompt_logprobs

    def run(tp: int) -> tuple[list[list[int]], list]:
        planes = planes_factory(tiny_qwen3_dir, "--tensor-parallel-size", str(tp), "--block-size", "16",
                                "--max-model-len", "256", start_timeout=START_TIMEOUT)
        with planes.client() as client, ThreadPoolExecutor(len(requests)) as pool:  # batched together
            tokens, scored = zip(*pool.map(lambda r: generate(client, r), requests))
        planes.stop()
        assert planes.dataplane.returncode == 0, "the data plane (and its worker) should stop cleanly"
        # the shared-memory block is released once, with no complaint from the resource tracker
        # (a child of the data plane, printing to the stderr this test captures)
        time.sleep(0.5)
        assert "Traceback" not in capfd.readouterr().err
        return list(tokens), scored[0]

    one, scored = run(1)
    assert [len(t) for t in one[1:-2]] == [24] * (len(requests) - 3) and len(one[-1]) < 24
    assert [p.token_id for p in scored] == prompts[2][1:]
    for ranks in (2, 4):  # 4: more ranks than the model's 2 KV heads, each replicated
        tokens, ranked = run(ranks)
        assert tokens == one, f"{ranks} ranks"
        assert [p.token_id for p in ranked] == prompts[2][1:], f"{ranks} ranks"
        assert [p.logprob for p in ranked] == pytest.approx([p.logprob for p in scored], abs=1e-4), f"{ranks} ranks"


def test_the_data_plane_exits_when_a_worker_dies(planes_factory, tiny_qwen3_dir):
    """A worker killed (out of memory, a device error) would leave rank 0 waiting for it forever, with
    health still SERVING: rank 0 exits instead, for whoever started it to start it again."""
    psutil = pytest.importorskip("psutil")
    planes = planes_factory(tiny_qwen3_dir, "--tensor-parallel-size", "2", "--block-size", "16",
                            "--max-model-len", "256", start_timeout=START_TIMEOUT)
    [worker] = [p for p in psutil.Process(planes.dataplane.pid).children()
                if any("spawn_main" in part for part in p.cmdline())]
    worker.kill()
    assert planes.dataplane.wait(30) == 1
