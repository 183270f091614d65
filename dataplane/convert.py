"""The data plane's edge: protobuf StepPlan -> plan objects, StepOutput -> StepResult."""

from __future__ import annotations

import dataclasses

import numpy as np

from twinplane.dataplane.plan import (PlanColumns, PromptLogprobsAsk, SamplingParams, SequenceInit, StepOutput,
                                     StepPlan)
from twinplane.proto import dataplane_pb2 as dp


def _ints(data: bytes, dtype: str = "<i4", name: str = "") -> np.ndarray:
    """A packed array (name: the field's, for the message that refuses a length no values fill)."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise ValueError(f"{name or 'a packed field'} holds {len(data)} bytes, not a whole number of {size}-byte "
                         "values")
    return np.frombuffer(data, dtype=dtype)


def init_from_pb(init: dp.SequenceInit) -> SequenceInit:
    s = init.sampling
    if len(s.logit_bias_ids) != len(s.logit_bias_values):
        raise ValueError(f"seq {init.seq_id}: {len(s.logit_bias_ids)} logit_bias_ids for "
                         f"{len(s.logit_bias_values)} logit_bias_values")
    sampling = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed if s.has_seed else None,
        num_logprobs=s.num_logprobs, min_tokens=s.min_tokens, stop_token_ids=tuple(s.stop_token_ids),
        logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values)), masked=s.masked,
    )
    prior = _ints(init.prior_token_ids, name=f"seq {init.seq_id}: prior_token_ids") if init.prior_token_ids else None
    return SequenceInit(sampling=sampling, num_prompt_tokens=init.num_prompt_tokens, prior_token_ids=prior)


def plan_from_pb(msg: dp.StepPlan) -> StepPlan:
    columns = PlanColumns(
        seq_ids=_ints(msg.seq_ids, "<i8", "seq_ids"),
        num_tokens=_ints(msg.num_tokens, name="num_tokens"),
        start_pos=_ints(msg.start_pos, name="start_pos"),
        token_ids=_ints(msg.token_ids, name="token_ids"),
        slot_mapping=_ints(msg.slot_mapping, name="slot_mapping"),
        num_new_blocks=_ints(msg.num_new_blocks, name="num_new_blocks"),
        new_block_ids=_ints(msg.new_block_ids, name="new_block_ids"),
        sample=_ints(msg.sample, np.uint8).astype(bool),
        inits={i.seq_id: init_from_pb(i) for i in msg.inits},
        decode_budget=_ints(msg.decode_budget, name="decode_budget") if msg.decode_budget else None,
        token_masks=masks_from_pb(msg),
        prompt_logprobs={a.index: PromptLogprobsAsk(_ints(a.next_token_ids, name="prompt_logprobs.next_token_ids"),
                                                    a.num_top) for a in msg.prompt_logprobs},
    )
    n = len(columns.seq_ids)
    if not (len(columns.num_tokens) == len(columns.start_pos) == len(columns.num_new_blocks)
            == len(columns.sample) == n):
        raise ValueError(f"plan columns disagree on the number of sequences ({n})")
    if (len(columns.token_ids) != columns.num_tokens.sum() or len(columns.slot_mapping) != len(columns.token_ids)
            or len(columns.new_block_ids) != columns.num_new_blocks.sum()):
        raise ValueError("plan token or block columns do not match their counts")
    if len(columns.prompt_logprobs) != len(msg.prompt_logprobs):
        raise ValueError("prompt_logprobs asks twice for one sequence")
    if columns.decode_budget is not None and len(columns.decode_budget) != n:
        raise ValueError(f"decode_budget has {len(columns.decode_budget)} entries for {n} sequences")
    return StepPlan(step_id=msg.step_id, dropped_seq_ids=list(msg.dropped_seq_ids), columns=columns,
                    num_steps=max(msg.num_steps, 1), masks_follow=msg.masks_follow)


def masks_from_pb(msg: dp.StepPlan) -> dict[int, bytes]:
    """A plan's token masks (or those of a masks_only message), by index in the plan; a mask sent as
    same_as is the earlier one's bytes object itself."""
    masks: dict[int, bytes] = {}
    for m in msg.token_masks:
        if m.index in masks:  # which of the two would hold is anyone's guess
            raise ValueError(f"two token masks for plan index {m.index}")
        if not m.allowed and m.same_as not in masks:
            raise ValueError(f"the token mask of plan index {m.index} is empty and refers to index {m.same_as}, "
                             "which has no mask before it")
        masks[m.index] = m.allowed or masks[m.same_as]
    return masks


def output_to_pb(out: StepOutput) -> dp.StepResult:
    result = dp.StepResult(
        step_id=out.step_id,
        sampled_token_ids=np.ascontiguousarray(out.sampled_token_ids, dtype="<i4").tobytes(),
        timings=dp.StepTimings(prepare_us=out.prepare_us, execute_us=out.execute_us, idle_us=out.idle_us,
                               path=int(out.path), launch_us=out.launch_us),
    )
    if out.sampled_logprobs is not None:
        result.sampled_logprobs = np.ascontiguousarray(out.sampled_logprobs, dtype="<f4").tobytes()
    for index, (ids, logprobs) in sorted(out.top_logprobs.items()):
        result.top_logprobs.add(index=index, token_ids=np.ascontiguousarray(ids, dtype="<i4").tobytes(),
                                logprobs=np.ascontiguousarray(logprobs, dtype="<f4").tobytes())
    for index, p in out.prompt_logprobs.items():  # in the asks' order
        result.prompt_logprobs.add(index=index, logprobs=np.ascontiguousarray(p.logprobs, dtype="<f4").tobytes(),
                                   top_token_ids=np.ascontiguousarray(p.top_ids, dtype="<i4").tobytes(),
                                   top_logprobs=np.ascontiguousarray(p.top_logprobs, dtype="<f4").tobytes(),
                                   ranks=np.ascontiguousarray(p.ranks, dtype="<i4").tobytes())
    return result


def describe_to_pb(description) -> dp.DescribeResponse:
    """description: the runner's describe() dataclass, named like DescribeResponse's fields."""
    return dp.DescribeResponse(**dataclasses.asdict(description))
