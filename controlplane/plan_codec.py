"""The control plane's side of the StepPlan / StepResult contract.

Per-sequence and per-token integers travel as packed little-endian arrays
(see proto/dataplane.proto): one ``tobytes`` per column instead of one
protobuf field per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinplane.controlplane.api import TokenLogprobs
from twinplane.controlplane.finish import stop_token_ids
from twinplane.controlplane.scheduler import SchedulerOutput
from twinplane.controlplane.sequence import PENDING, Sequence
from twinplane.proto import dataplane_pb2 as dp


def sequence_init(seq: Sequence, eos_token_ids: tuple[int, ...], start_pos: int) -> dp.SequenceInit:
    params, s = seq.params, seq.params.sampling
    masked = stop_token_ids(params, eos_token_ids)  # while min_tokens is not reached
    sampling = dp.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, has_seed=s.seed is not None, seed=s.seed or 0,
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
        min_tokens=params.min_tokens, stop_token_ids=sorted(masked) if params.min_tokens else [],
        logit_bias_ids=[i for i, _ in params.logit_bias], logit_bias_values=[v for _, v in params.logit_bias],
        masked=seq.matcher is not None,
    )
    init = dp.SequenceInit(seq_id=seq.seq_id, sampling=sampling, num_prompt_tokens=seq.num_prompt_tokens)
    if s.has_penalties and start_pos > 0:  # the prefix came from the cache: the sampler needs its tokens
        init.prior_token_ids = np.asarray(seq.token_ids[:start_pos], dtype="<i4").tobytes()
    return init


def encode_plan(out: SchedulerOutput, block_size: int, eos_token_ids: tuple[int, ...]) -> dp.StepPlan:
    decodes, starts = out.decode_seqs, out.decode_start
    # plain decodes first: one token each, sampled, no new block, already mirrored
    seq_ids = [s.seq_id for s in decodes]
    token_ids = [s.token_ids[p] for s, p in zip(decodes, starts)]
    slots = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, starts)]
    start_pos = list(starts)
    num_tokens = [1] * len(decodes)
    sample = [1] * len(decodes)
    num_new_blocks = [0] * len(decodes)
    new_blocks: list[int] = []
    inits = []
    masked = [i for i, s in enumerate(decodes) if s.matcher is not None]
    follow = any(token_ids[i] == PENDING and not decodes[i].matcher.fixed for i in masked)
    asks, out.prompt_asks = [], []
    for c in out.other_chunks:
        seq, end = c.seq, c.start_pos + c.num_tokens
        if seq.prompt_logprobs is not None and c.start_pos < seq.num_prompt_tokens - 1:
            # position p scores prompt token p + 1; the prompt's last position samples instead
            scored = seq.token_ids[c.start_pos + 1:min(end, seq.num_prompt_tokens - 1) + 1]
            asks.append(dp.PromptLogprobsAsk(index=len(seq_ids), next_token_ids=np.asarray(scored, "<i4").tobytes(),
                                             num_top=seq.params.prompt_logprobs))
            out.prompt_asks.append((seq, c.start_pos + 1))
        if c.sample and seq.matcher is not None:
            masked.append(len(seq_ids))
            follow = follow or seq.token_ids[end - 1] == PENDING and not seq.matcher.fixed
        seq_ids.append(seq.seq_id)
        num_tokens.append(c.num_tokens)
        start_pos.append(c.start_pos)
        sample.append(c.sample)
        num_new_blocks.append(len(c.new_block_ids))
        new_blocks.extend(c.new_block_ids)
        token_ids.extend(seq.token_ids[c.start_pos:end])
        pos = np.arange(c.start_pos, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
        if c.is_new_mirror:
            inits.append(sequence_init(seq, eos_token_ids, c.start_pos))
    # a sequence whose mask depends on the PENDING token it decodes: the masks wait for it
    out.masks_due = masked if follow else []
    return dp.StepPlan(
        step_id=out.step_id,
        seq_ids=np.asarray(seq_ids, dtype="<i8").tobytes(),
        num_tokens=np.asarray(num_tokens, dtype="<i4").tobytes(),
        start_pos=np.asarray(start_pos, dtype="<i4").tobytes(),
        token_ids=np.asarray(token_ids, dtype="<i4").tobytes(),
        slot_mapping=np.asarray(slots, dtype="<i4").tobytes(),
        num_new_blocks=np.asarray(num_new_blocks, dtype="<i4").tobytes(),
        new_block_ids=np.asarray(new_blocks, dtype="<i4").tobytes(),
        sample=np.asarray(sample, dtype=np.uint8).tobytes(),
        inits=inits,
        dropped_seq_ids=out.dropped_seq_ids,
        num_steps=out.num_steps,
        decode_budget=np.asarray(out.decode_budget, dtype="<i4").tobytes(),
        token_masks=[] if follow else token_masks(out, masked),
        masks_follow=follow,
        prompt_logprobs=asks,
    )


def token_masks(out: SchedulerOutput, indexes: list[int]) -> list[dp.TokenMask]:
    """The masks of the plan's sampled sequences with structured output (indexes: their places in the
    plan), from where each stands in its grammar now; a mask that an earlier one equals is sent as a
    reference to it (``TokenMask.same_as``)."""
    seqs = out.seqs
    masks, first = [], {}  # a mask's bytes -> the first index it went with
    for i in indexes:
        allowed = seqs[i].matcher.mask()
        earlier = first.setdefault(allowed, i)  # the cache hands out one bytes object per state: hashed once
        masks.append(dp.TokenMask(index=i, allowed=allowed) if earlier == i else dp.TokenMask(index=i, same_as=earlier))
    return masks


def masks_message(out: SchedulerOutput) -> dp.StepPlan:
    """The token masks of a plan sent with masks_follow: sent once the result of the plan before it has
    been applied, whose tokens they depend on."""
    return dp.StepPlan(step_id=out.step_id, masks_only=True, token_masks=token_masks(out, out.masks_due))


@dataclass
class StepTokens:
    """A decoded StepResult: one entry per sampled sequence, in plan order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    idle_us: int = 0
    execute_us: int = 0
    prepare_us: int = 0
    launch_us: int = 0
    path: int = dp.STEP_PATH_EAGER  # how the data plane ran the forward pass (dataplane.proto StepPath)
    # per prompt log-probabilities ask, in the plan's order: (log-probability, top (id, log-probability) pairs,
    # rank or None) at each of its positions
    prompt_logprobs: list[list[tuple[float, list[tuple[int, float]], int | None]]] = field(default_factory=list)


def decode_result(res: dp.StepResult) -> StepTokens:
    token_ids = np.frombuffer(res.sampled_token_ids, dtype="<i4").tolist()
    logprobs: list[TokenLogprobs | None] = []
    if res.sampled_logprobs:
        values = np.frombuffer(res.sampled_logprobs, dtype="<f4").tolist()
        top = {t.index: (np.frombuffer(t.token_ids, dtype="<i4").tolist(),
                         np.frombuffer(t.logprobs, dtype="<f4").tolist()) for t in res.top_logprobs}
        for i, (token_id, value) in enumerate(zip(token_ids, values)):
            ids, lps = top.get(i, ([], []))
            logprobs.append(TokenLogprobs(token_id, value, list(zip(ids, lps))))
    t = res.timings
    tokens = StepTokens(token_ids, logprobs, t.idle_us, t.execute_us, t.prepare_us, t.launch_us, t.path)
    for p in res.prompt_logprobs:
        values = np.frombuffer(p.logprobs, dtype="<f4").tolist()
        top_ids = np.frombuffer(p.top_token_ids, dtype="<i4").reshape(len(values), -1).tolist()
        top_lps = np.frombuffer(p.top_logprobs, dtype="<f4").reshape(len(values), -1).tolist()
        ranks = np.frombuffer(p.ranks, dtype="<i4").tolist() if p.ranks else [None] * len(values)
        tokens.prompt_logprobs.append([(v, list(zip(i, lp)), rank)
                                       for v, i, lp, rank in zip(values, top_ids, top_lps, ranks)])
    return tokens


def store_prompt_logprobs(out: SchedulerOutput, tokens: StepTokens) -> None:
    """Puts a step's prompt log-probabilities into the sequences that asked for them (each keeps them
    until its first output token takes them along)."""
    for (seq, first), scored in zip(out.prompt_asks, tokens.prompt_logprobs):
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs[first:first + len(scored)] = [TokenLogprobs(seq.token_ids[first + j], value, top, rank)
                                                              for j, (value, top, rank) in enumerate(scored)]
