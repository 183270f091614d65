"""``twinplane bench``'s workloads: nano-vLLM's draws, draw for draw, and the older interleaved draws."""

from __future__ import annotations

import random
from collections import Counter

from twinplane.clients.bench import make_workload
from twinplane.clients.cli import build_parser


def bench_args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def nanovllm_draws(num_seqs: int, max_input_len: int, max_ouput_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vLLM's bench.py, restated: seed(0), every prompt, then every max_tokens."""
    rng = random.Random(0)  # the same sequence as random.seed(0) and the module-level functions
    prompt_token_ids = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
                        for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_ouput_len) for _ in range(num_seqs)]
    return prompt_token_ids, max_tokens


def test_default_workload_is_nanovllms_draw_for_draw():
    requests = make_workload(bench_args())
    prompts, max_tokens = nanovllm_draws(256, 1024, 1024)
    assert [len(r.prompt) for r in requests] == [len(p) for p in prompts]
    assert [r.prompt[:8] for r in requests] == [p[:8] for p in prompts]
    assert [r.prompt for r in requests] == prompts
    assert [r.max_tokens for r in requests] == max_tokens
    # pinned, so that a change to the draws shows even if the restatement changed with it
    assert (len(requests[0].prompt), requests[0].prompt[:3], max_tokens[:3]) == (964, [6311, 6890, 663], [845, 312, 607])
    assert sum(max_tokens) == 133_966  # the output tokens of nano-vLLM's own run (BENCHMARKS.md)


def test_nanovllm_workload_follows_the_size_flags():
    requests = make_workload(bench_args("--num-requests", "5", "--max-input", "300", "--max-output", "200"))
    prompts, max_tokens = nanovllm_draws(5, 300, 200)
    assert [(r.prompt, r.max_tokens) for r in requests] == list(zip(prompts, max_tokens))


def test_interleaved_workload_keeps_the_older_rows_draws():
    requests = make_workload(bench_args("--workload", "interleaved"))
    rng = random.Random(0)
    for r in requests:
        assert r.prompt == [rng.randrange(10000) for _ in range(rng.randint(100, 1024))]
        assert r.max_tokens == rng.randint(100, 1024)
    assert sum(r.max_tokens for r in requests) == 137_723  # BENCHMARKS.md's rows before nano-vLLM's order


def test_shared_prefixes_come_after_nanovllms_draws():
    requests = make_workload(bench_args("--num-requests", "8", "--num-prefixes", "2", "--prefix-len", "5"))
    prompts, max_tokens = nanovllm_draws(8, 1024, 1024)
    assert [r.prompt[5:] for r in requests] == prompts and [r.max_tokens for r in requests] == max_tokens
    prefixes = Counter(tuple(r.prompt[:5]) for r in requests)
    assert sorted(prefixes.values()) == [4, 4]
    assert all(0 <= t <= 10000 for prefix in prefixes for t in prefix)
