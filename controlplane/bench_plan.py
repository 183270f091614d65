"""CPU cost of planning one decode step on the control plane.

    python -m twinplane.controlplane.bench_plan --num-seqs 1024

Builds --num-seqs running sequences in decode (prompts of --prompt-len tokens, already
computed), then times schedule() + encode_plan() + SerializeToString() for one decode
step, and update() of its result, over --repeats steps; prints the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.plan_codec import encode_plan
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import RequestParams, Sequence


def build(num_seqs: int, prompt_len: int, block_size: int) -> Scheduler:
    blocks = num_seqs * (-(-(prompt_len + 1024) // block_size))
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs),
                                      max_model_len=prompt_len + 1024), BlockManager(blocks, block_size))
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        sched.add(Sequence(i, str(i), rng.integers(0, 10000, prompt_len).tolist(), RequestParams(max_tokens=1024)))
    while sched.waiting or any(s.num_uncomputed_tokens != 1 for s in sched.running):
        out = sched.schedule()  # prefill until every sequence is in decode
        sched.update(out, [1] * sum(c.sample for c in out.chunks))
    return sched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    sched = build(args.num_seqs, args.prompt_len, args.block_size)
    plan_times, update_times = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        out = sched.schedule()
        data = encode_plan(out, args.block_size, (0,)).SerializeToString()
        planned = time.perf_counter()
        sched.update(out, [1] * out.num_batched_tokens)
        update_times.append(time.perf_counter() - planned)
        plan_times.append(planned - started)
    assert len(out.decode_seqs) == args.num_seqs, "not a plain decode step"
    print(f"{args.num_seqs} sequences in decode: plan + encode {statistics.median(plan_times) * 1e3:.3f} ms "
          f"(plan message {len(data)} bytes), update {statistics.median(update_times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
