"""Decode step time of the data plane alone, with and without CUDA graphs.

    python -m twinplane.dataplane.bench_decode --model dummy:qwen3-0.6b --batch-sizes 1 64 256
    python -m twinplane.dataplane.bench_decode --profile --batch-sizes 128 256 --context 1024
    python -m twinplane.dataplane.bench_decode --plan-steps 8 --batch-sizes 1 2 4
    python -m twinplane.dataplane.bench_decode --kv-cache-dtype fp8 --batch-sizes 64 256

For each batch size, that many sequences are prefilled to --context tokens, then
--steps greedy decode steps are timed one by one (wall clock of ModelRunner.step,
which ends with the sampled ids on the host); the median is printed next to the
time the step's weight and KV bytes need at --peak-bandwidth-gbs.

``--plan-steps K``: instead, plans of K decode steps each (as the control plane sends a few
sequences that only decode), one at a time; per token, the medians of the device time of a
plan (on a GPU, between its CUDA events), of the host time that queueing it took (its
``launch_us``) and of its wall clock. A plan whose host time nears its device time keeps the
GPU waiting when plans are sent back to back. Where the runner replays graphs that sample
(``decode_graphs.py``), the same plans queued step by step follow on a second line.

``--profile``: instead, the decode steps run under ``torch.profiler`` (CUDA graphs where the
runner has them), and for each batch size the kernels of a step are listed by their time
per step (on a CPU device: the operators, by their own CPU time), and on a GPU how much of a
step's span, first kernel to last, some kernel runs. ``--profile --prompts``: the same for
prompt steps, each prefilling that many new sequences of --context tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from twinplane.dataplane.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, DataPlaneConfig
from twinplane.dataplane.plan import SamplingParams, ScheduledSeq, SequenceInit, StepPlan

GREEDY = SequenceInit(SamplingParams(temperature=0.0), num_prompt_tokens=0)


def chunk(seq_id: int, tokens: np.ndarray, start: int, blocks: list[int], block_size: int, first: bool,
          decode_budget: int = 1) -> ScheduledSeq:
    """The sequence's tokens from position ``start`` on, sampled greedily, in ``blocks`` (sent
    with its first chunk, with which it is new to the data plane)."""
    positions = np.arange(start, start + len(tokens))
    slots = (np.asarray(blocks)[positions // block_size] * block_size + positions % block_size).astype(np.int32)
    return ScheduledSeq(seq_id, tokens.astype(np.int32), start, slots,
                        np.asarray(blocks if first else [], dtype=np.int32), True, GREEDY if first else None,
                        decode_budget)


class DecodeBatch:
    """`batch` sequences prefilled to `context` tokens (with blocks for `steps` more), decoded greedily."""

    def __init__(self, runner, batch: int, context: int, steps: int) -> None:
        self.runner, self.step_id, self.seqs = runner, 0, []
        bs = runner.config.block_size
        blocks_per_seq = -(-(context + steps + 1) // bs)
        rng = np.random.default_rng(0)
        for i in range(batch):  # prefill one at a time to stay under max_num_batched_tokens
            blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            out = self._step([chunk(i, rng.integers(0, 10000, context), 0, blocks, bs, True)])
            self.seqs.append([blocks, context, int(out.sampled_token_ids[0])])

    def _step(self, chunks, num_steps: int = 1):
        out = self.runner.step(StepPlan(self.step_id, chunks, num_steps=num_steps))
        self.step_id += 1
        return out

    def _decode_step(self, num_steps: int = 1):
        """One plan of `num_steps` decode steps of every sequence; returns its StepOutput and wall seconds."""
        bs = self.runner.config.block_size
        chunks = [chunk(i, np.array([last]), pos, blocks, bs, False, num_steps)
                  for i, (blocks, pos, last) in enumerate(self.seqs)]
        started = time.perf_counter()
        out = self._step(chunks, num_steps)
        wall = time.perf_counter() - started
        for seq, tokens in zip(self.seqs, out.sampled_token_ids.reshape(len(self.seqs), num_steps).tolist()):
            seq[1] += num_steps
            seq[2] = tokens[-1]
        return out, wall

    def decode(self, steps: int) -> list[float]:
        """Runs `steps` decode steps of every sequence; returns the seconds of each."""
        return [self._decode_step()[1] for _ in range(steps)]

    def decode_plans(self, plans: int, num_steps: int) -> list[tuple[int, int, float]]:
        """Runs `plans` plans of `num_steps` decode steps of every sequence; returns each plan's
        device time and host launch time (us) and its wall clock (seconds)."""
        results = []
        for _ in range(plans):
            out, wall = self._decode_step(num_steps)
            results.append((out.execute_us, out.launch_us, wall))
        return results


def time_plans(runner, batch: int, context: int, num_steps: int, plans: int) -> str:
    """One line: the medians per token of plans of `num_steps` decode steps of `batch` sequences."""
    warm = 2
    decoding = DecodeBatch(runner, batch, context, (plans + warm) * num_steps)
    decoding.decode_plans(warm, num_steps)
    results = decoding.decode_plans(plans, num_steps)
    runner.reset()
    device, host, wall = (statistics.median(column) for column in zip(*results))
    return (f"batch {batch}, context {context}, plans of {num_steps} steps: per token {device / num_steps:.1f} us "
            f"on the device, {host / num_steps:.1f} us of host launch, {wall * 1e6 / num_steps:.1f} us wall")


def time_decode(runner, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step for `batch` sequences of `context` tokens."""
    times = DecodeBatch(runner, batch, context, steps).decode(steps)
    runner.reset()
    return statistics.median(times)


def prefill(runner, batch: int, context: int, steps: int) -> list[float]:
    """Runs `steps` prompt steps, each prefilling `batch` new sequences of `context` tokens (the
    last step's dropped by the next); returns the seconds of each."""
    bs = runner.config.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    rng = np.random.default_rng(0)
    times, ids = [], []
    for step in range(steps):
        chunks = [chunk(step * batch + i, rng.integers(0, 10000, context), 0,
                         list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), bs, True) for i in range(batch)]
        started = time.perf_counter()
        runner.step(StepPlan(step, chunks, dropped_seq_ids=ids))
        times.append(time.perf_counter() - started)
        ids = [chunk.seq_id for chunk in chunks]
    runner.reset()
    return times


def step_spans(kernels: list[tuple[float, float]], step_gap_us: float = 200.0) -> list[tuple[float, float, int]]:
    """(span, busy time, kernels) of each step in the kernel intervals (start, end) in us, sorted by
    start: a step ends where the GPU then ran nothing for longer than step_gap_us. Busy time is the
    union of the intervals, so kernels that overlap (programmatic dependent launch) count once."""
    steps: list[tuple[float, float, int]] = []
    first = end = busy = None
    count = 0
    for start, stop in kernels:
        if end is not None and start - end > step_gap_us:
            steps.append((end - first, busy, count))
            end = None
        if end is None:
            first, end, busy, count = start, stop, stop - start, 1
            continue
        busy += max(0.0, stop - max(start, end))
        end, count = max(end, stop), count + 1
    if end is not None:
        steps.append((end - first, busy, count))
    return steps


def profile_decode(runner, batch: int, context: int, steps: int, top: int = 16, prompts: bool = False) -> str:
    """A table of the kernels (CPU: operators) of one decode step (``prompts``: one step prefilling
    `batch` sequences), by time per step, over `steps` steps."""
    import torch

    cuda = runner.device.type == "cuda"
    if prompts:
        prefill(runner, batch, context, 3)  # warm-up
        run = lambda: prefill(runner, batch, context, steps)  # noqa: E731
    else:
        decoding = DecodeBatch(runner, batch, context, steps + 3)
        decoding.decode(3)  # warm-up
        run = lambda: decoding.decode(steps)  # noqa: E731
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        wall = run()
    runner.reset()
    rows = [(e.self_device_time_total if cuda else e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()]
    rows = [row for row in rows if row[0] > 0]
    total, count = sum(r[0] for r in rows) / steps, sum(r[1] for r in rows) / steps
    what = "kernels" if cuda else "operators (own CPU time)"
    kind = "prompt" if prompts else "decode"
    lines = [f"{kind} batch {batch}, context {context}: step {statistics.median(wall) * 1e3:.3f} ms (median wall), "
             f"{what} {total / 1e3:.3f} ms in {count:.0f} calls per step"]
    for us, n, name in sorted(rows, reverse=True)[:top]:
        lines.append(f"{us / steps:10.1f} us/step {n / steps:6.1f} x {us / n:8.2f} us  {name[:90]}")
    if cuda:  # each step's kernels (the host waits between steps), less the copies of its inputs
        kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Mem"))
        spans = [step for step in step_spans(kernels) if step[2] >= 10]
        if spans:
            span, busy = (statistics.median(column) for column in list(zip(*spans))[:2])
            lines.append(f"GPU busy {100 * busy / span:.1f}% of a step's {span / 1e3:.3f} ms from its first kernel "
                         f"to its last (medians of {len(spans)} steps; the rest is gaps between kernels)")
        from twinplane.kernels.device import launch_pdl

        if launch_pdl(runner.device):
            lines.append("(kernels launched with programmatic dependent launch count their wait for the kernel "
                         "ahead as their own time: their times overlap, and can add up to more than the step)")
    return "\n".join(lines)


def main() -> None:
    from twinplane.dataplane.model_runner import ModelRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--peak-bandwidth-gbs", type=float, default=4800.0)
    p.add_argument("--profile", action="store_true", help="list each step's kernels under torch.profiler instead")
    p.add_argument("--prompts", action="store_true", help="with --profile: prompt steps of --context tokens a sequence")
    p.add_argument("--plan-steps", type=int, default=0, metavar="K",
                   help="time plans of K decode steps instead (device, host launch and wall time per token)")
    p.add_argument("--plans", type=int, default=20, help="plans to time with --plan-steps")
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = p.parse_args()

    prompt_tokens = max(8192, max(args.batch_sizes) * args.context) if args.prompts else 8192

    def runner_for(enforce_eager: bool = False) -> ModelRunner:
        return ModelRunner(DataPlaneConfig(model=args.model, block_size=args.block_size, enforce_eager=enforce_eager,
                                           device=args.device, max_num_seqs=max(args.batch_sizes),
                                           attention_backend=args.attention_backend,
                                           kv_cache_dtype=args.kv_cache_dtype,
                                           max_num_batched_tokens=prompt_tokens,
                                           gpu_memory_utilization=0.85))

    if args.profile or args.plan_steps:
        runner = runner_for()
        for batch in args.batch_sizes:
            if args.profile:
                print(profile_decode(runner, batch, args.context, args.steps, prompts=args.prompts), flush=True)
            else:
                print(time_plans(runner, batch, args.context, args.plan_steps, args.plans), flush=True)
                if runner.decode_graphs is not None:  # the same plans, queued step by step
                    graphs = runner.decode_graphs
                    runner.use_decode_graphs(None)
                    print("  step by step: " + time_plans(runner, batch, args.context, args.plan_steps, args.plans),
                          flush=True)
                    runner.use_decode_graphs(graphs)
        runner.close()
        return
    rows = []
    for eager in (False, True):
        runner = runner_for(eager)
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
