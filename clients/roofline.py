"""The step-by-step roofline of a benchmark workload: the least time a GPU could take for it.

``step_roofline`` first plans the steps the workload needs, with a simplified copy of the
control plane's scheduler (``plan_steps``): requests arrive all at once, in order; each step
gives every running sequence in decode its next token, then spends what is left of
``max_num_batched_tokens`` (at most ``max_prefill_tokens_with_decode`` when the step also
decodes, unless the step before left a request waiting) on prefill chunks, running sequences
first, then admitting waiting ones while fewer than ``max_num_seqs`` run. A request samples its
first token in the step that ends its prompt and one more in each decode step, and leaves once it
has ``max_tokens``. Nothing is preempted (the KV cache is taken as large enough) and no prompt
token is found in the prefix cache.

Each planned step then takes max(bytes / bandwidth, FLOPs / peak):

- bytes: the weights once, plus the K/V each sequence of the step attends to (its whole context
  up to its last token in the step, read once) and the K/V of the tokens it computes (written);
- FLOPs: 2 per decoder-layer weight per token computed, 2 per output-projection weight
  (hidden_size x vocab_size) per sampled token, and 4 x layers x query heads x head_dim per
  (query token, context token) pair of causal attention (QK^T and PV).

So prompt steps of 8,192 tokens are compute-bound and decode steps bandwidth-bound, and the
sum is a truer floor than bytes alone. No step overlaps another and kernels are assumed to
reach peak: real steps are slower.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLimits:
    """The scheduler's budgets of one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_with_decode: int | None = None


@dataclass(frozen=True)
class ModelCost:
    """What a model moves and computes, per unit of work (all GPUs together)."""

    weight_bytes: int  # read once per step
    kv_bytes_per_token: int  # K and V of one token, all layers
    layer_params: int  # decoder-layer matrix weights: 2 FLOPs each per token computed
    logits_params: int  # hidden_size x vocab_size: 2 FLOPs each per sampled token
    attention_flops_per_pair: int  # 4 x layers x query heads x head_dim, per (query, context) token pair

    def step_bytes(self, work: StepWork) -> int:
        return self.weight_bytes + (work.kv_read + work.num_tokens) * self.kv_bytes_per_token

    def step_flops(self, work: StepWork) -> int:
        return (2 * self.layer_params * work.num_tokens + 2 * self.logits_params * work.num_sampled
                + self.attention_flops_per_pair * work.attention_pairs)


@dataclass
class StepWork:
    """The work of one planned step, summed over its sequences."""

    num_tokens: int = 0  # tokens computed (their K/V written)
    num_sampled: int = 0  # tokens sampled
    attention_pairs: int = 0  # (query token, context token) pairs under the causal mask
    kv_read: int = 0  # tokens whose K/V is read: each sequence's context up to its last token here

    def add_chunk(self, start: int, num_tokens: int, sample: bool) -> None:
        """Tokens [start, start + num_tokens) of one sequence; token p attends to tokens 0..p."""
        self.num_tokens += num_tokens
        self.num_sampled += sample
        self.attention_pairs += num_tokens * start + num_tokens * (num_tokens + 1) // 2
        self.kv_read += start + num_tokens


@dataclass
class _Running:
    prompt_len: int
    max_tokens: int
    num_computed: int = 0
    num_output: int = 0


def plan_steps(requests: list[tuple[int, int]], limits: StepLimits) -> list[StepWork]:
    """The steps that (prompt length, max_tokens) requests, all arriving at once, need under limits."""
    waiting = deque(_Running(prompt_len, max_tokens) for prompt_len, max_tokens in requests)
    running: list[_Running] = []
    steps = []
    queued = False  # the step before left a request waiting: no cap
    while waiting or running:
        work, budget = StepWork(), limits.max_num_batched_tokens
        shares = [(seq, 1) for seq in running if seq.num_computed >= seq.prompt_len]  # decodes first
        budget -= len(shares)
        lift = queued and len(running) < limits.max_num_seqs  # the step before left one waiting that fits now
        if shares and limits.max_prefill_tokens_with_decode is not None and not lift:
            budget = min(budget, limits.max_prefill_tokens_with_decode)
        for seq in running:
            if seq.num_computed < seq.prompt_len and budget > 0:
                shares.append((seq, min(seq.prompt_len - seq.num_computed, budget)))
                budget -= shares[-1][1]
        while waiting and budget > 0 and len(running) < limits.max_num_seqs:
            running.append(waiting.popleft())
            shares.append((running[-1], min(running[-1].prompt_len, budget)))
            budget -= shares[-1][1]
        assert shares, f"no step fits in {limits}"
        for seq, num_tokens in shares:
            sample = seq.num_computed + num_tokens >= seq.prompt_len
            work.add_chunk(seq.num_computed, num_tokens, sample)
            seq.num_computed += num_tokens
            seq.num_output += sample
        running = [seq for seq in running if seq.num_output < seq.max_tokens]
        queued = bool(waiting)
        steps.append(work)
    return steps


@dataclass(frozen=True)
class StepRoofline:
    seconds: float  # the sum over steps of max(bytes time, FLOPs time)
    bandwidth_seconds: float  # the sum over steps of the bytes time alone
    num_steps: int
    compute_bound_steps: int  # steps whose FLOPs take longer than their bytes


def step_roofline(requests: list[tuple[int, int]], limits: StepLimits, cost: ModelCost,
                  bandwidth_bytes: float, peak_flops: float) -> StepRoofline:
    """The roofline of (prompt length, max_tokens) requests; bandwidth in bytes/s, peak in FLOP/s."""
    seconds = bandwidth_seconds = 0.0
    compute_bound = 0
    steps = plan_steps(requests, limits)
    for work in steps:
        moving, computing = cost.step_bytes(work) / bandwidth_bytes, cost.step_flops(work) / peak_flops
        seconds += max(moving, computing)
        bandwidth_seconds += moving
        compute_bound += computing > moving
    return StepRoofline(seconds, bandwidth_seconds, len(steps), compute_bound)
