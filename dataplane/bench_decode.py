"""Decode step time of the data plane alone, with and without CUDA graphs.

    python -m twinplane.dataplane.bench_decode --model dummy:qwen3-0.6b --batch-sizes 1 64 256

For each batch size, that many sequences are prefilled to --context tokens, then
--steps greedy decode steps are timed one by one (wall clock of ModelRunner.step,
which ends with the sampled ids on the host); the median is printed next to the
time the step's weight and KV bytes need at --peak-bandwidth-gbs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.plan import SamplingParams, ScheduledSeq, SequenceInit, StepPlan

GREEDY = SequenceInit(SamplingParams(temperature=0.0), num_prompt_tokens=0)


def _chunk(seq_id: int, tokens: np.ndarray, start: int, blocks: list[int], block_size: int, first: bool):
    positions = np.arange(start, start + len(tokens))
    slots = (np.asarray(blocks)[positions // block_size] * block_size + positions % block_size).astype(np.int32)
    return ScheduledSeq(seq_id, tokens.astype(np.int32), start, slots,
                        np.asarray(blocks if first else [], dtype=np.int32), True, GREEDY if first else None)


def time_decode(runner, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step for `batch` sequences of `context` tokens."""
    bs = runner.config.block_size
    blocks_per_seq = -(-(context + steps + 1) // bs)
    rng = np.random.default_rng(0)
    seqs, step_id = [], 0
    for i in range(batch):  # prefill one at a time to stay under max_num_batched_tokens
        blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        prompt = rng.integers(0, 10000, context)
        out = runner.step(StepPlan(step_id, [_chunk(i, prompt, 0, blocks, bs, True)]))
        seqs.append([blocks, context, int(out.sampled_token_ids[0])])
        step_id += 1
    times = []
    for _ in range(steps):
        plan = StepPlan(step_id, [_chunk(i, np.array([last]), pos, blocks, bs, False)
                                  for i, (blocks, pos, last) in enumerate(seqs)])
        started = time.perf_counter()
        out = runner.step(plan)
        times.append(time.perf_counter() - started)
        for s, token in zip(seqs, out.sampled_token_ids.tolist()):
            s[1] += 1
            s[2] = token
        step_id += 1
    runner.reset()
    return statistics.median(times)


def main() -> None:
    from twinplane.dataplane.model_runner import ModelRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--peak-bandwidth-gbs", type=float, default=4800.0)
    args = p.parse_args()
    rows = []
    for eager in (False, True):
        runner = ModelRunner(DataPlaneConfig(model=args.model, block_size=args.block_size, enforce_eager=eager,
                                             max_num_seqs=max(args.batch_sizes), gpu_memory_utilization=0.85))
        d = runner.describe()
        for batch in args.batch_sizes:
            seconds = time_decode(runner, batch, args.context, args.steps)
            traffic = d.weight_bytes + batch * (args.context + args.steps // 2) * d.kv_bytes_per_token
            rows.append((batch, "eager" if eager else "graphs", seconds, traffic / (args.peak_bandwidth_gbs * 1e9)))
        runner.close()
    print(f"{args.model}, context {args.context}, block size {args.block_size}")
    print(f"{'batch':>5} {'mode':>7} {'step ms':>8} {'roofline ms':>12} {'of roofline':>12}")
    for batch, mode, seconds, roofline in rows:
        print(f"{batch:>5} {mode:>7} {seconds * 1e3:>8.2f} {roofline * 1e3:>12.2f} {100 * roofline / seconds:>11.1f}%")


if __name__ == "__main__":
    main()
