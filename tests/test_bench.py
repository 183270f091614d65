"""``twinplane bench``'s workloads (nano-vLLM's draws, draw for draw) and its step roofline, on the CPU."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

from twinplane.clients.bench import Request, _one, make_workload, roofline_seconds, workload_step_roofline
from twinplane.clients.client import build_request
from twinplane.clients.cli import build_parser
from twinplane.clients.roofline import ModelCost, StepLimits, StepWork, plan_steps, step_roofline


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
    assert (len(requests[0].prompt), requests[0].prompt[:3], max_tokens[:3]) == \
        (964, [6311, 6890, 663], [845, 312, 607])
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


# ---- the step roofline -------------------------------------------------------------------------


def test_plan_steps_decodes_first_then_chunks_prompts_within_the_token_budget():
    # prompt 6 then 3 tokens, 2 tokens out each; 4 tokens a step
    steps = plan_steps([(6, 2), (3, 2)], StepLimits(max_num_seqs=2, max_num_batched_tokens=4))
    assert steps == [
        StepWork(num_tokens=4, num_sampled=0, attention_pairs=1 + 2 + 3 + 4, kv_read=4),  # first: tokens 0-3
        # first: tokens 4-5, samples; second admitted: tokens 0-1
        StepWork(num_tokens=4, num_sampled=1, attention_pairs=(5 + 6) + (1 + 2), kv_read=6 + 2),
        # first decodes (its last token); second: token 2, samples
        StepWork(num_tokens=2, num_sampled=2, attention_pairs=7 + 3, kv_read=7 + 3),
        StepWork(num_tokens=1, num_sampled=1, attention_pairs=4, kv_read=4),  # second decodes
    ]


def test_plan_steps_admits_no_more_than_max_num_seqs():
    steps = plan_steps([(1, 2)] * 3, StepLimits(max_num_seqs=2, max_num_batched_tokens=8))
    assert [(s.num_tokens, s.num_sampled) for s in steps] == [(2, 2), (2, 2), (1, 1), (1, 1)]


def test_plan_steps_caps_prompt_tokens_beside_decodes():
    steps = plan_steps([(2, 3), (8, 1)], StepLimits(max_num_seqs=2, max_num_batched_tokens=4,
                                                    max_prefill_tokens_with_decode=1))
    # 1: the first whole and 2 of the second's 8 (no decode yet, no cap); 2, 3: the first decodes, the
    # second gets 1 prompt token beside it; 4: the second's last 4 alone
    assert [s.num_tokens for s in steps] == [4, 1 + 1, 1 + 1, 4]


def test_plan_steps_lifts_the_cap_while_a_request_waits():
    limits = StepLimits(max_num_seqs=2, max_num_batched_tokens=100, max_prefill_tokens_with_decode=3)
    steps = plan_steps([(2, 3), (1, 1), (8, 1)], limits)
    # 1: the first two admitted, whole; the third waits for a place (max_num_seqs); 2: it is admitted
    # whole beside the first's decode, as the step before left it waiting; 3: the first's last decode
    assert [s.num_tokens for s in steps] == [3, 1 + 8, 1]


def test_one_request_compute_bound_prompt_then_bandwidth_bound_decodes():
    # prompt 4, 3 tokens out: a prompt step (4 tokens, samples) and two decodes (positions 4 and 5)
    cost = ModelCost(weight_bytes=1000, kv_bytes_per_token=10, layer_params=1000, logits_params=50,
                     attention_flops_per_pair=2)
    bandwidth, peak = 1000.0, 4000.0  # bytes/s, FLOP/s
    # bytes: 1000 + 10 x (read + written)     FLOPs: 2 x 1000 x tokens + 2 x 50 x sampled + 2 x pairs
    # prompt:  1000 + 10 x (4 + 4) = 1080 -> 1.08 s   8000 + 100 + 2 x 10 = 8120 -> 2.03 s (compute-bound)
    # decode:  1000 + 10 x (5 + 1) = 1060 -> 1.06 s   2000 + 100 + 2 x 5  = 2110 -> 0.5275 s
    # decode:  1000 + 10 x (6 + 1) = 1070 -> 1.07 s   2000 + 100 + 2 x 6  = 2112 -> 0.528 s
    roofline = step_roofline([(4, 3)], StepLimits(1, 8), cost, bandwidth, peak)
    assert roofline.seconds == pytest.approx(2.03 + 1.06 + 1.07)
    assert roofline.bandwidth_seconds == pytest.approx(1.08 + 1.06 + 1.07)
    assert (roofline.num_steps, roofline.compute_bound_steps) == (3, 1)


def test_bench_takes_the_step_roofline_from_the_model_info():
    info = SimpleNamespace(data_parallel_size=2, tensor_parallel_size=1, max_num_seqs=1, max_num_batched_tokens=8,
                           weight_bytes=500, kv_bytes_per_token=10, layer_params=1000, hidden_size=5,
                           vocab_size=10, num_hidden_layers=1, num_attention_heads=1, head_dim=1)
    args = bench_args("--peak-bandwidth-gbs", "5e-7", "--peak-tflops", "2e-9", "--max-num-seqs", "7")
    requests = [SimpleNamespace(prompt=[0] * 4, max_tokens=3)]
    # two data planes as one machine twice their size: 2 x 500 weight bytes a step, 1000 B/s, 4000 FLOP/s;
    # the one-request case above with 4 FLOPs per pair: prompt 8140 FLOPs, decodes 2120 and 2124
    roofline = workload_step_roofline(requests, info, args)
    assert roofline.seconds == pytest.approx(8140 / 4000 + 1.06 + 1.07)
    assert roofline.compute_bound_steps == 1


def test_both_rooflines_agree_on_bytes_for_one_decode_only_request():
    """With a one-token prompt and no FLOPs, the step roofline differs from the bandwidth roofline only
    by the K/V of the last output token, which no step computes (the bandwidth roofline writes it)."""
    cost = ModelCost(weight_bytes=100, kv_bytes_per_token=1, layer_params=0, logits_params=0,
                     attention_flops_per_pair=0)
    by_step = step_roofline([(1, 5)], StepLimits(1, 8), cost, 1.0, 1.0)
    bandwidth_only = roofline_seconds([SimpleNamespace(prompt=[0], max_tokens=5)], 100, 1, 1, 1.0)
    assert by_step.seconds == by_step.bandwidth_seconds == bandwidth_only - 1


def test_arrival_times_are_one_poisson_process_drawn_with_the_workload():
    """--request-rate R: request i is sent at the i-th arrival of one Poisson process of rate R (so
    client processes that split the requests together keep rate R); without it, all at time 0."""
    assert {r.at for r in make_workload(bench_args("--num-requests", "50"))} == {0.0}
    requests = make_workload(bench_args("--num-requests", "4000", "--request-rate", "20"))
    times = [r.at for r in requests]
    assert times == sorted(times) and times[0] > 0
    assert 4000 / times[-1] == pytest.approx(20, rel=0.05)  # 1.6% standard error at n = 4000
    shares = [times[i::4] for i in range(4)]  # each of 4 client processes sends its share at those times
    assert all(len(share) / share[-1] == pytest.approx(5, rel=0.1) for share in shares)
    again = make_workload(bench_args("--num-requests", "4000", "--request-rate", "20"))
    assert [r.at for r in again] == times  # drawn from --seed: the same on every run


def test_masked_requests_are_drawn_apart_from_the_workload():
    flags = ("--masked-share", "0.25", "--masked-regex", "[a-z]*")
    plain, masked = make_workload(bench_args()), make_workload(bench_args(*flags))
    assert [(r.prompt, r.max_tokens) for r in masked] == [(r.prompt, r.max_tokens) for r in plain]
    assert sum(r.regex == "[a-z]*" for r in masked) == 64 and not any(r.regex for r in plain)
    assert [r.regex for r in masked] == [r.regex for r in make_workload(bench_args(*flags))]


def test_the_report_gives_structured_and_other_requests_their_own_pace(capsys):
    """With --masked-share, the report prints each group's time per output token apart."""
    from twinplane.clients.bench import Request, report
    from twinplane.controlplane.replica import STAT_NAMES

    info = SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1, max_num_seqs=4, max_num_batched_tokens=64,
                           weight_bytes=500, kv_bytes_per_token=10, layer_params=1000, hidden_size=5, vocab_size=10,
                           num_hidden_layers=1, num_attention_heads=1, head_dim=1, model="m", dtype="bf16",
                           device="cpu", attention_backend="torch", num_kv_blocks=8, block_size=16)
    stats = dict.fromkeys(STAT_NAMES, 0) | {"preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                                            "dataplanes": []}
    requests = [Request([1, 2], 3, sent=0.0, token_times=[0.1, 0.2, 0.3], regex="[a-z]*"),  # 0.1 s a token
                Request([1, 2], 3, sent=0.0, token_times=[0.1, 0.3, 0.5], regex="[a-z]*"),  # 0.2 s
                Request([1, 2], 3, sent=0.0, token_times=[0.1, 0.15, 0.2])]  # 0.05 s
    figures = report(requests, 1.0, stats, stats, info, bench_args("--max-num-seqs", "4"))
    assert figures["structured_tpot_p50_s"] == pytest.approx(0.15) and figures["free_tpot_p50_s"] == pytest.approx(0.05)
    assert "time per output token: 2 structured requests p50 150.0 ms" in capsys.readouterr().out
    assert "structured_tpot_p50_s" not in report(requests[2:], 1.0, stats, stats, info, bench_args())


def test_the_model_line_names_a_kv_cache_dtype_other_than_the_models():
    from twinplane.clients.bench import _kv_dtype

    assert _kv_dtype(SimpleNamespace(dtype="bfloat16", kv_cache_dtype="float8_e4m3fn")) == " in float8_e4m3fn"
    assert _kv_dtype(SimpleNamespace(dtype="bfloat16", kv_cache_dtype="bfloat16")) == ""
    assert _kv_dtype(SimpleNamespace(dtype="bfloat16", kv_cache_dtype="")) == ""  # a server older than the field


def test_each_request_samples_alike_whatever_the_models_generation_defaults():
    """A bench request sends the built-in value of every sampling field a model's generation config may default
    (Qwen3's top_k 20, top_p 0.95...), so a run samples as it did before servers took those defaults."""
    sent = []

    class Recorder:
        def generate(self, **kwargs):
            sent.append(build_request(**kwargs))
            return _no_chunks()

    asyncio.run(_one(Recorder(), Request([1, 2, 3], 5), bench_args(), SimpleNamespace(update=lambda n: None)))
    from twinplane.controlplane.api import sampling_from_pb
    from twinplane.controlplane.sequence import SamplingOptions

    qwen3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
    sampling = sent[0].sampling
    assert sampling_from_pb(sampling, qwen3) == replace(SamplingOptions(), temperature=sampling.temperature)
    assert sampling.temperature == pytest.approx(0.6)  # --temperature's default


async def _no_chunks():
    return
    yield
