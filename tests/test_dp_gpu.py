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
