"""The data plane on CUDA (skipped without a GPU): reference logits, measured KV cache, dummy models."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from tests.test_dp_helpers import PlanBuilder
from tests.test_dp_reference import Harness, _prompt, _save_reference
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.input_batch import PENDING
from twinplane.dataplane.plan import SamplingParams, StepPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_runner_matches_transformers(tmp_path: Path) -> None:
    reference = _save_reference("qwen3", tmp_path, sharded=False)
    runner = ModelRunner(DataPlaneConfig(model=str(tmp_path), block_size=16, num_kv_blocks=64, dtype="float32",
                                         device="cuda", max_model_len=256))
    h, g = Harness(reference, runner, 16, atol=1e-3), torch.Generator().manual_seed(1)
    a, b = h.builder.new_seq(1, _prompt(g, 21)), h.builder.new_seq(2, _prompt(g, 30))
    h.run([h.builder.schedule(a), h.builder.schedule(b, 17, sample=False)], [a])
    for _ in range(3):  # the first of these finishes b's prefill next to a's decode
        h.run([h.builder.schedule(a), h.builder.schedule(b)], [a, b])


@pytest.mark.parametrize("model", ["dummy:qwen3-0.6b", "dummy:qwen3-8b"])
def test_dummy_models_measure_the_cache_and_decode(model: str) -> None:
    started = time.perf_counter()
    runner = ModelRunner(DataPlaneConfig(model=model, device="cuda", block_size=256, max_num_batched_tokens=8192,
                                         gpu_memory_utilization=0.8))
    description = runner.describe()
    print(f"\n{model}: start-up {time.perf_counter() - started:.1f}s, {description}")
    assert description.dtype == "bfloat16" and description.num_kv_blocks > 100
    builder = PlanBuilder(256)
    seqs = [builder.new_seq(i, list(range(100 + i, 600 + i)), SamplingParams(temperature=0.8, seed=i))
            for i in range(8)]
    for step in range(6):
        out = runner.step(StepPlan(step, [builder.schedule(s) for s in seqs]))
        for s, t in zip(seqs, out.sampled_token_ids.tolist()):
            s.tokens.append(t)
        print(f"step {step}: prepare {out.prepare_us} us, execute {out.execute_us} us")
    runner.close()


def _large_segments() -> dict[int, int]:
    """address: bytes of each cudaMalloc that the caching allocator's large pool holds."""
    return {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot() if s["segment_type"] == "large"}


def test_logits_gemm_sees_only_row_counts_warmed_up_at_start() -> None:
    """cuBLAS stalls the host ~18 ms on each new GEMM shape: a step's logits rows are padded to the
    counts start-up ran, and a step that samples more rows than any before allocates no memory."""
    gc.collect()  # as in a fresh data plane: no blocks cached by earlier tests' runners
    torch.cuda.empty_cache()
    runner = ModelRunner(DataPlaneConfig(model="dummy:qwen3-0.6b", device="cuda", block_size=256, max_num_seqs=64,
                                         max_num_batched_tokens=2048, gpu_memory_utilization=0.5))
    segments = _large_segments()
    seen = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: seen.append(hidden.shape[0]) or compute_logits(hidden)
    builder = PlanBuilder(256)
    for step, rows in enumerate((5, 23, 64)):
        seqs = [builder.new_seq(100 * step + i, list(range(1, 20)), SamplingParams(temperature=0.7))
                for i in range(rows)]
        out, logits = runner.step_with_logits(StepPlan(step, [builder.schedule(s) for s in seqs]))
        assert len(out.sampled_token_ids) == rows and logits.shape[0] == rows
    assert seen == [8, 32, 64] and set(seen) <= set(runner.logit_rows)
    new = [size for address, size in _large_segments().items() if address not in segments]
    assert not new, f"steps allocated segments of {new} bytes"
    runner.close()


SLEEP_CYCLES = 1_000_000_000  # about half a second of GPU clock: far longer than launching a step takes


def _launch_behind_busy_gpu(runner: ModelRunner, plan: StepPlan):
    """Launches plan while the GPU is still busy with earlier work; returns the launched step and
    whether that earlier work was still running when the launch returned."""
    torch.cuda._sleep(SLEEP_CYCLES)
    earlier = torch.cuda.Event()
    earlier.record()
    step = runner.launch(plan)
    still_busy = not earlier.query()
    step.result()
    return step, still_busy


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3),
    SamplingParams(temperature=0.7, repetition_penalty=1.2, min_tokens=4, stop_token_ids=[2], num_logprobs=2),
], ids=["greedy", "temperature", "top-p-top-k-seeded", "penalties-min-tokens-logprobs"])
def test_launch_queues_a_step_without_waiting_for_the_gpu(sampling: SamplingParams) -> None:
    """A launch only queues work: the data plane launches the next step while the GPU runs the
    current one, so a launch that waited for the GPU (a copy from pageable memory, a read of a
    device value) would leave the GPU idle for the rest of it. Checked for a prefill, graphed
    decode steps fed the previous step's tokens on the device (PENDING) and, where the sampling
    allows it, a plan of several decode steps."""
    runner = ModelRunner(DataPlaneConfig(model="dummy:qwen3-0.6b", device="cuda", block_size=256, max_num_seqs=16,
                                         max_num_batched_tokens=1024, gpu_memory_utilization=0.3))
    builder = PlanBuilder(256)
    several = (not sampling.has_penalties and sampling.seed is None and sampling.num_logprobs < 0
               and sampling.min_tokens == 0)
    for round_ in range(2):  # the first round compiles and warms up every shape; the second is checked
        seqs = [builder.new_seq(10 * round_ + i, list(range(5 + i, 40 + 3 * i)), sampling) for i in range(3)]
        launched = [_launch_behind_busy_gpu(runner, StepPlan(0, [builder.schedule(s) for s in seqs]))]
        for step in (1, 2):
            for s in seqs:
                s.tokens.append(PENDING)  # the token the previous step sampled, still on the GPU
            launched.append(_launch_behind_busy_gpu(runner, StepPlan(step, [builder.schedule(s) for s in seqs])))
        if several:
            for s in seqs:
                s.tokens.append(PENDING)
            scheduled = [builder.schedule(s, decode_budget=4) for s in seqs]
            launched.append(_launch_behind_busy_gpu(runner, StepPlan(3, scheduled, num_steps=4)))
        paths = [(step.path.name, still_busy) for step, still_busy in launched]
        if round_ == 1:
            assert all(still_busy for _, still_busy in paths), f"a launch waited for the GPU: {paths}"
            assert ("DECODE_GRAPH", True) in paths and (("MULTI_DECODE", True) in paths) == several, paths
    runner.close()
