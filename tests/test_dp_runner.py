"""ModelRunner on dummy:tiny-qwen3: describe, plan validation, mirrors, seeds, logprobs, and the
step inputs' layout (alignment, dtypes shared with the CUDA-graph buffers)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.test_dp_helpers import PlanBuilder
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.convert import describe_to_pb
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.plan import PromptLogprobsAsk, SamplingParams, ScheduledSeq, SequenceInit, StepPlan

BLOCK = 4


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(DataPlaneConfig(model="dummy:tiny-qwen3", block_size=BLOCK, num_kv_blocks=64,
                                       max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64))


def test_describe_fills_the_proto(runner: ModelRunner) -> None:
    description = runner.describe()
    assert (description.architecture, description.dtype, description.device) == ("Qwen3ForCausalLM", "float32", "cpu")
    assert (description.vocab_size, description.num_kv_blocks, description.max_model_len) == (49152, 64, 64)
    assert description.attention_backend == "torch" and description.eos_token_ids == [2]
    assert describe_to_pb(description).masks_follow  # it takes plans whose token masks follow them
    assert describe_to_pb(description).max_logprobs == 20
    assert not describe_to_pb(description).generation_config.ListFields()  # a dummy model has no generation config
    shape = (description.hidden_size, description.num_hidden_layers, description.num_attention_heads,
             description.head_dim)
    assert shape == (64, 2, 4, 16)
    qkv, o, gate_up, down = 64 * (4 + 2 * 2) * 16, 4 * 16 * 64, 64 * 2 * 128, 128 * 64
    assert description.layer_params == 2 * (qkv + o + gate_up + down)  # matrices only, no norm weights


def test_cpu_cache_size_follows_the_gib_budget() -> None:
    small = ModelRunner(DataPlaneConfig(model="dummy:tiny-qwen3", block_size=16, cpu_kv_cache_gib=1 / 1024))
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, float32
    assert small.num_kv_blocks == (1 << 20) // per_block


def _bad_plans(builder: PlanBuilder) -> dict[str, StepPlan]:
    def fresh(seq_id: int, prompt: list[int], **changes) -> StepPlan:
        scheduled = builder.schedule(builder.new_seq(seq_id, prompt))
        return StepPlan(0, [dataclasses.replace(scheduled, **changes)])

    negative = StepPlan(0, [builder.schedule(builder.new_seq(67, [1, 2])),
                            builder.schedule(builder.new_seq(68, [3] * 5))])
    cols = negative.cols()
    cols.num_new_blocks = np.array([-1, cols.num_new_blocks.sum() + 1], np.int32)  # as many block ids in all
    unstored = builder.schedule(builder.new_seq(69, [1, 2]))
    unstored.slot_mapping[1] = -1  # the right slot for its first token, none for its second
    return {
        "negative blocks": negative,
        "unknown": StepPlan(0, [dataclasses.replace(builder.schedule(builder.new_seq(50, [1, 2])), init=None)]),
        "vocab": fresh(51, [1, 2], token_ids=np.array([1, 49152], np.int32)),
        "slot": fresh(52, [1, 2], slot_mapping=np.array([0, 64 * BLOCK], np.int32)),
        "table": fresh(53, [1, 2], slot_mapping=np.array([0, 1], np.int32)),
        "unstored": StepPlan(0, [unstored]),
        "max_model_len": fresh(54, [1, 2], start_pos=63),
        "block id": fresh(55, [1, 2], new_block_ids=np.array([64], np.int32)),
        # slots that agree with a block -1: only the block id check stands between them and the KV cache
        "negative block id": fresh(70, [1, 2], new_block_ids=np.array([-1], np.int32),
                                   slot_mapping=np.array([-BLOCK, 1 - BLOCK], np.int32)),
        "batch": fresh(56, [1] * 65),
        "repeated": StepPlan(0, [builder.schedule(builder.new_seq(57, [1, 2]))] * 2),
        "bias id": StepPlan(0, [builder.schedule(builder.new_seq(58, [1, 2], SamplingParams(
            logit_bias=((49152, 1.0),))))]),
        "bias value": StepPlan(0, [builder.schedule(builder.new_seq(59, [1, 2], SamplingParams(
            logit_bias=((3, float("nan")),))))]),
        "prompt positions": fresh(60, [1, 2], prompt_logprobs=PromptLogprobsAsk(np.array([2, 3, 4], np.int32))),
        "prompt token": fresh(61, [1, 2], prompt_logprobs=PromptLogprobsAsk(np.array([49152], np.int32))),
        "prompt top": fresh(62, [1, 2], prompt_logprobs=PromptLogprobsAsk(np.array([2], np.int32), num_top=21)),
        "start overflow": fresh(63, [1, 2], start_pos=2**31 - 1),  # + 2 tokens wraps around in int32
        "prompt length": fresh(64, [1, 2], init=SequenceInit(SamplingParams(), 2**31)),
        "tiny temperature": StepPlan(0, [builder.schedule(builder.new_seq(65, [1, 2], SamplingParams(
            temperature=1e-7)))]),
        "penalty": StepPlan(0, [builder.schedule(builder.new_seq(66, [1, 2], SamplingParams(
            presence_penalty=float("inf"))))]),
    }


BAD_PLAN_MESSAGES = {"repeated": "schedules a seq_id more than once", "bias id": "logit_bias token ids outside",
                     "bias value": "logit_bias values not finite",
                     "prompt positions": "asks at 3 positions of a chunk of 2 tokens; 1 to the chunk's tokens",
                     "prompt token": r"next token ids outside \[0, 49152\)",
                     "prompt top": "asks for the top 21 tokens, max_logprobs is 20",
                     "start overflow": "positions exceed max_model_len",
                     "prompt length": "num_prompt_tokens 2147483648",
                     "negative blocks": "num_new_blocks >= 0", "unstored": "slot_mapping disagrees",
                     "block id": r"new_block_ids must be in \[0, 64\)",
                     "negative block id": r"new_block_ids must be in \[0, 64\)",
                     "tiny temperature": "neither 0 \\(greedy\\) nor", "penalty": "penalties not finite"}


@pytest.mark.parametrize("case", ["unknown", "vocab", "slot", "table", "unstored", "max_model_len", "block id", "batch",
                                  "repeated", "bias id", "bias value", "prompt positions", "prompt token",
                                  "prompt top", "negative blocks", "start overflow", "prompt length",
                                  "tiny temperature", "penalty", "negative block id"])
def test_bad_plans_fail_the_step_not_the_runner(runner: ModelRunner, case: str) -> None:
    runner.reset()
    builder = PlanBuilder(BLOCK, first_block=20)
    with pytest.raises(ValueError, match=BAD_PLAN_MESSAGES.get(case)):
        runner.step(_bad_plans(builder)[case])
    assert len(runner.sequences) == 0, "a rejected plan must not change the mirrors"
    good = builder.new_seq(1, [5, 6, 7])
    assert runner.step(StepPlan(1, [builder.schedule(good)])).sampled_token_ids.shape == (1,)


def test_a_decode_plan_naming_an_unknown_sequence_is_refused(runner: ModelRunner) -> None:
    """A plan without inits (the decode fast path) still names a sequence the data plane never saw."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    known = builder.new_seq(1, [3, 4, 5])
    known.tokens.append(int(runner.step(StepPlan(1, [builder.schedule(known)])).sampled_token_ids[0]))
    stranger = dataclasses.replace(builder.schedule(builder.new_seq(9, [1, 2])), init=None)
    with pytest.raises(ValueError, match="seq 9: unknown to the data plane"):
        runner.step(StepPlan(2, [builder.schedule(known), stranger]))
    assert set(runner.sequences.mirrors) == {1}


@pytest.mark.parametrize("masks, message", [
    ({}, r"token masks for sequences \[\] of the plan; wanted one for each sampled sequence with a masked "
         r"sampler, \[1\]"),
    ({0: b"\xff" * 6144}, r"wanted one for each sampled sequence with a masked sampler, \[1\]"),
    ({1: b"\xff" * 6143}, "a token mask must be 6144 bytes"),
    ({1: bytes(6144)}, "none set"),
])
def test_token_masks_come_with_masked_sequences_only_and_whole(runner: ModelRunner, masks, message) -> None:
    """Structured output: a masked sequence needs its mask (one bit per token of the 49,152) in each plan that
    samples it, and no other sequence gets one; a plan that breaks that fails and leaves no mirror behind."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    free, masked = builder.new_seq(1, [3, 4, 5]), builder.new_seq(2, [6, 7], SamplingParams(masked=True))
    plan = StepPlan(1, [builder.schedule(free), builder.schedule(masked)])
    plan.cols().token_masks = masks
    with pytest.raises(ValueError, match=message):
        runner.step(plan)
    assert not runner.sequences.mirrors


def test_a_refused_decode_plan_leaves_the_block_tables_as_they_were(runner: ModelRunner) -> None:
    """A decode plan (one token a sequence) that appends a block for one sequence and fails a check on
    another changes no block table; the corrected plan then runs."""
    runner.reset()
    builder, batch = PlanBuilder(BLOCK), runner.sequences
    a, b = builder.new_seq(1, [3, 4, 5, 6]), builder.new_seq(2, [7, 8])
    out = runner.step(StepPlan(1, [builder.schedule(a), builder.schedule(b)]))
    for seq, token in zip((a, b), out.sampled_token_ids.tolist()):
        seq.tokens.append(token)
    grow, stay = builder.schedule(a), builder.schedule(b)
    assert (len(grow.new_block_ids), len(stay.new_block_ids)) == (1, 0)

    def tables() -> dict[int, list[int]]:
        return {s: batch.block_table[r, :batch.num_blocks[r]].tolist() for s, r in batch.row_of.items()}

    before = tables()
    with pytest.raises(ValueError, match="slot_mapping disagrees"):
        runner.step(StepPlan(2, [grow, dataclasses.replace(stay, slot_mapping=stay.slot_mapping + 1)]))
    assert tables() == before
    assert runner.step(StepPlan(3, [grow, stay])).sampled_token_ids.shape == (2,)
    assert tables() == {1: before[1] + grow.new_block_ids.tolist(), 2: before[2]}


def test_a_plan_that_skips_positions_of_a_known_sequence_is_refused(runner: ModelRunner) -> None:
    """A sequence's plan goes on where its plans so far ended, or earlier: past it, attention would read
    keys and values that no plan stored (what another sequence left in the block). Refused whole; a
    prefix-cache hit starts a new sequence past position 0, and a plan may also store positions again."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, list(range(3, 13)))  # 10 prompt tokens
    runner.step(StepPlan(1, [builder.schedule(seq, num_tokens=2, sample=False)]))
    seq.num_computed = 4  # positions 2 and 3 never sent
    gapped = builder.schedule(seq, num_tokens=4, sample=False)
    with pytest.raises(ValueError, match="seq 1: plan starts at position 4, past the 2 positions its plans"):
        runner.step(StepPlan(2, [gapped]))
    row = runner.sequences.row_of[1]
    assert runner.sequences.num_sent[row] == 2  # as before the refused plan
    seq.num_computed, seq.sent_blocks = 1, 1  # from an earlier position (stores position 1 again); block 1 anew
    runner.step(StepPlan(3, [builder.schedule(seq, num_tokens=5, sample=False)]))
    assert runner.sequences.num_sent[row] == 6
    hit = builder.new_seq(2, list(range(3, 13)), shared_blocks=seq.blocks[:1])  # starts at position 4
    out = runner.step(StepPlan(4, [builder.schedule(seq), builder.schedule(hit)]))
    assert out.sampled_token_ids.shape == (2,)


def test_drop_and_reset_forget_sequences(runner: ModelRunner) -> None:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    a, b = builder.new_seq(1, [3, 4, 5]), builder.new_seq(2, [6, 7])
    runner.step(StepPlan(1, [builder.schedule(a), builder.schedule(b)]))
    assert len(runner.sequences) == 2
    out = runner.step(StepPlan(2, [], dropped_seq_ids=[1]))
    assert out.sampled_token_ids.shape == (0,) and set(runner.sequences.mirrors) == {2}
    runner.reset()
    assert len(runner.sequences) == 0


def _generate(runner: ModelRunner, prompt: list[int], steps: int, sampling: SamplingParams,
              recompute_after: int | None = None) -> list[int]:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, prompt, sampling)
    for step in range(steps):
        out = runner.step(StepPlan(step, [builder.schedule(seq)]))
        seq.tokens.append(int(out.sampled_token_ids[0]))
        if step == recompute_after:  # preempt: drop, then re-prefill prompt + outputs in new blocks
            tokens, seq = seq.tokens, builder.new_seq(1, seq.tokens[: len(prompt)], sampling)
            seq.tokens = list(tokens)
            runner.step(StepPlan(100 + step, [], dropped_seq_ids=[1]))
    return seq.tokens[len(prompt):]


def test_seeded_sampling_survives_recompute(runner: ModelRunner) -> None:
    sampling = SamplingParams(temperature=1.0, seed=11)
    prompt = [10, 11, 12, 13, 14]
    straight = _generate(runner, prompt, 6, sampling)
    recomputed = _generate(runner, prompt, 6, sampling, recompute_after=2)
    assert straight == recomputed
    assert straight != _generate(runner, prompt, 6, SamplingParams(temperature=1.0, seed=12))


def test_step_output_carries_logprobs(runner: ModelRunner) -> None:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    a = builder.new_seq(1, [1, 2, 3], SamplingParams(temperature=0.0, num_logprobs=3))
    b = builder.new_seq(2, [4, 5], SamplingParams(temperature=0.0))
    out, logits = runner.step_with_logits(StepPlan(1, [builder.schedule(a), builder.schedule(b)]))
    assert out.sampled_logprobs is not None and out.sampled_logprobs.shape == (2,)
    assert set(out.top_logprobs) == {0}
    ids, logprobs = out.top_logprobs[0]
    assert ids[0] == out.sampled_token_ids[0] and np.all(np.diff(logprobs) <= 0)
    np.testing.assert_allclose(logprobs[0], logits[0].log_softmax(-1).max().item(), rtol=1e-5)
    with pytest.raises(ValueError, match="num_logprobs"):
        c = builder.new_seq(3, [1], SamplingParams(num_logprobs=21))
        runner.step(StepPlan(2, [builder.schedule(c)]))


def _pending_decode(builder: PlanBuilder, seq) -> ScheduledSeq:
    """The next decode of seq with its last token PENDING (sampled by the previous plan, not yet read)."""
    seq.tokens.append(-1)
    return builder.schedule(seq)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.0, repetition_penalty=1.5, seed=3)])
def test_pending_tokens_are_fed_back_on_the_device(runner: ModelRunner, sampling: SamplingParams) -> None:
    """Plans launched before the previous result is read decode the tokens it sampled."""
    prompt = [10, 11, 12, 13, 14]
    expected = _generate(runner, prompt, 5, sampling)
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, prompt, sampling)
    launched = [runner.launch(StepPlan(0, [builder.schedule(seq)]))]
    for step in range(1, 5):  # every plan goes out before the previous step's tokens are read
        launched.append(runner.launch(StepPlan(step, [_pending_decode(builder, seq)])))
    tokens = [int(step.result().sampled_token_ids[0]) for step in launched]
    assert tokens == expected
    history = runner.sequences.tokens[runner.sequences.row_of[1]]  # kept only where penalties read it
    assert history[5:10].tolist() == (tokens if sampling.has_penalties else [-1] * 5)
    assert history[:5].tolist() == (prompt if sampling.has_penalties else [-1] * 5)


def test_pending_token_needs_a_sample_in_the_previous_plan(runner: ModelRunner) -> None:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    a, b = builder.new_seq(1, [1, 2, 3]), builder.new_seq(2, [4, 5, 6])
    runner.step(StepPlan(1, [builder.schedule(a), builder.schedule(b, sample=False)]))
    with pytest.raises(ValueError, match="pending"):  # b sampled nothing
        runner.step(StepPlan(2, [_pending_decode(builder, b)]))
    runner.step(StepPlan(3, []))
    with pytest.raises(ValueError, match="pending"):  # a sampled two plans ago
        runner.step(StepPlan(4, [_pending_decode(builder, a)]))
    c = builder.new_seq(3, [7, 8])
    with pytest.raises(ValueError, match="pending"):  # not the single token of its chunk
        runner.step(StepPlan(5, [dataclasses.replace(builder.schedule(c), token_ids=np.array([7, -1], np.int32))]))
    d = builder.new_seq(4, [7, 8, 9])
    with pytest.raises(ValueError, match="pending"):  # inside a prompt chunk (it would index the embedding at -1)
        runner.step(StepPlan(6, [dataclasses.replace(builder.schedule(d), token_ids=np.array([7, -1, 9], np.int32))]))
    assert 4 not in runner.sequences.row_of  # refused whole: the new sequence is not kept


def test_a_plan_whose_sequences_write_one_kv_slot_is_refused(runner: ModelRunner) -> None:
    """Two sequences of one plan given the same block to write would lose one's keys and values to the
    other's: the plan is refused whole. Sharing a full cached block they do not write is allowed, in one
    plan as in the next."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    a = builder.new_seq(1, [1, 2, 3, 4, 5])  # blocks 0, 1
    first = builder.schedule(a)
    builder.next_block = 1
    b = builder.new_seq(2, [6, 7, 8])  # block 1 too, written by both
    with pytest.raises(ValueError, match="two tokens in one KV slot"):
        runner.step(StepPlan(1, [first, builder.schedule(b)]))
    assert not runner.sequences.mirrors  # nothing kept
    shared = builder.new_seq(3, [1, 2, 3, 4, 9], shared_blocks=[0])  # a's first block, computed by a in this plan
    out = runner.step(StepPlan(2, [first, builder.schedule(shared)]))
    assert out.sampled_token_ids.shape == (2,)


def test_a_plan_of_several_steps_whose_later_steps_write_one_kv_slot_is_refused(runner: ModelRunner) -> None:
    """The slots a plan of several decode steps writes after its first step are its sequences' own too."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    a, b = builder.new_seq(1, [1, 2, 3]), builder.new_seq(2, [4, 5, 6])  # blocks 0 and 1
    out = runner.step(StepPlan(1, [builder.schedule(a), builder.schedule(b)]))
    a.tokens.append(int(out.sampled_token_ids[0]))
    b.tokens.append(int(out.sampled_token_ids[1]))
    first = builder.schedule(a, decode_budget=3)  # positions 3, 4, 5: block 2 after the first step
    builder.next_block = 2
    second = builder.schedule(b, decode_budget=3)  # its first slot its own, its later ones in block 2 as well
    assert first.slot_mapping.tolist() != second.slot_mapping.tolist()
    with pytest.raises(ValueError, match="two tokens in one KV slot"):
        runner.step(StepPlan(2, [first, second], num_steps=3))


def _held_logits(runner: ModelRunner, disturb=lambda builder, seq: None) -> list[torch.Tensor]:
    """Sequence 1's logits over its prefill and 3 decodes, with ``disturb`` called before each decode."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    held = builder.new_seq(1, [3, 4, 5, 6, 7, 8])  # blocks 0 and 1, block 1 half written
    logits = []
    for step in range(4):
        if step:
            disturb(builder, held)
        out, step_logits = runner.step_with_logits(StepPlan(10 * step, [builder.schedule(held)]))
        held.tokens.append(int(out.sampled_token_ids[0]))
        logits.append(step_logits)
    return logits


def test_a_plan_that_writes_a_block_another_sequence_holds_is_refused(runner: ModelRunner) -> None:
    """A block in another held sequence's table is not the writer's: a plan that stores a token there (a
    partly written block, a full prefix block it shares, in a later step of several, or a block its own table
    names twice) is refused, and the holder's logits stay those of an undisturbed run. Sharing a full block
    without writing it is allowed, and a dropped holder's blocks may be written again."""
    unbroken = _held_logits(runner)
    refusals = []

    def disturb(builder: PlanBuilder, held) -> None:
        def refused(plan: StepPlan, message: str = "plan writes KV block [01], which another held sequence") -> None:
            with pytest.raises(ValueError, match=message):
                runner.step(plan)
            refusals.append(plan.step_id)

        k = len(refusals) // 4  # blocks 10k + 10 .. 10k + 13 are this call's own
        builder.next_block = 1  # held's half-written block
        refused(StepPlan(100 * k + 1, [builder.schedule(builder.new_seq(100 + k, [1, 2]))]))
        inside = builder.new_seq(200 + k, [3, 4, 5, 6], shared_blocks=[0])
        inside.num_computed = 3  # stores position 3, in the shared block
        refused(StepPlan(100 * k + 2, [builder.schedule(inside)]))
        builder.next_block = 10 * k + 10
        own = builder.new_seq(300 + k, [9] * (BLOCK - 1))
        own.tokens.append(int(runner.step(StepPlan(100 * k + 3, [builder.schedule(own)])).sampled_token_ids[0]))
        builder.next_block = 1  # its next block is held's: the plan's second step stores a token there
        refused(StepPlan(100 * k + 4, [builder.schedule(own, decode_budget=2)], num_steps=2))
        twice = builder.new_seq(400 + k, [5] * 2 * BLOCK)
        twice.blocks = [10 * k + 11] * 2
        refused(StepPlan(100 * k + 5, [builder.schedule(twice)]), "two tokens in one KV slot")
        builder.next_block = 10 * k + 12
        sharing = builder.new_seq(500 + k, [3, 4, 5, 6, 9], shared_blocks=[0])
        assert runner.step(StepPlan(100 * k + 6, [builder.schedule(sharing)])).sampled_token_ids.shape == (1,)

    disturbed = _held_logits(runner, disturb)
    assert len(refusals) == 12
    for want, got in zip(unbroken, disturbed):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    builder = PlanBuilder(BLOCK, first_block=1)
    runner.step(StepPlan(100, [], dropped_seq_ids=[1]))
    assert runner.step(StepPlan(101, [builder.schedule(builder.new_seq(9, [1, 2]))])).sampled_token_ids.shape == (1,)
    runner.reset()


def test_a_block_new_in_a_plan_is_written_by_one_sequence_only(runner: ModelRunner) -> None:
    """Two sequences of one plan handed the same new block may not both write it (each at slots of its own):
    one's keys and values would sit among the other's. One of them may hold it unwritten (a prefix block the
    plan computes for the other), and the refused plan leaves the block free for the next."""
    runner.reset()
    builder = PlanBuilder(BLOCK, first_block=5)
    first = builder.new_seq(1, [3, 4])  # positions 0-1 of block 5
    second = builder.new_seq(2, [3, 4, 7, 8])
    second.blocks, second.num_computed = [5], 2  # positions 2-3 of block 5 too
    with pytest.raises(ValueError, match="plan writes KV block 5 from two sequences"):
        runner.step(StepPlan(1, [builder.schedule(first), builder.schedule(second)]))
    assert not runner.sequences.mirrors and not runner.sequences.block_holders.any()
    builder.next_block = 5
    assert runner.step(StepPlan(2, [builder.schedule(builder.new_seq(1, [3, 4]))])).sampled_token_ids.shape == (1,)
    runner.reset()


def test_a_held_sequence_sent_again_from_scratch_may_write_its_own_blocks_again(runner: ModelRunner) -> None:
    """A SequenceInit for a held sequence (as after a preemption) that names its own blocks again computes into
    them: the old row's table no longer counts. In a refused plan the old row keeps them, and they stay its
    own: no other sequence may write them."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, PROMPT)
    _decode(runner, builder, seq, 2)

    def again():
        scratch = builder.new_seq(1, PROMPT)
        scratch.blocks = list(seq.blocks)
        return builder.schedule(scratch)

    other = builder.schedule(builder.new_seq(2, [3, 4]))
    with pytest.raises(ValueError, match="slot_mapping disagrees"):
        runner.step(StepPlan(10, [again(), dataclasses.replace(other, slot_mapping=other.slot_mapping + 1)]))
    stranger = builder.new_seq(3, [7, 8])
    stranger.blocks = [seq.blocks[0]]
    with pytest.raises(ValueError, match=f"plan writes KV block {seq.blocks[0]}, which another held sequence"):
        runner.step(StepPlan(11, [builder.schedule(stranger)]))
    assert runner.step(StepPlan(12, [again()])).sampled_token_ids.tolist() == [seq.tokens[len(PROMPT)]]
    runner.reset()


@pytest.mark.parametrize("field", ["seq_ids", "num_tokens", "start_pos", "token_ids", "slot_mapping", "num_new_blocks",
                                   "new_block_ids", "decode_budget"])
def test_packed_fields_no_whole_number_of_values_fill_are_refused_by_name(field: str) -> None:
    from twinplane.dataplane.convert import plan_from_pb
    from twinplane.proto import dataplane_pb2 as dp

    width = 8 if field == "seq_ids" else 4
    with pytest.raises(ValueError, match=f"^{field} holds {width + 1} bytes, not a whole number of {width}-byte"):
        plan_from_pb(dp.StepPlan(step_id=1, **{field: bytes(width + 1)}))


def test_two_token_masks_for_one_sequence_are_refused() -> None:
    from twinplane.dataplane.convert import masks_from_pb
    from twinplane.proto import dataplane_pb2 as dp

    plan = dp.StepPlan(step_id=1, token_masks=[dp.TokenMask(index=0, allowed=_only(5)),
                                               dp.TokenMask(index=0, allowed=_only(6))])
    with pytest.raises(ValueError, match="two token masks for plan index 0"):
        masks_from_pb(plan)


def test_step_arrays_start_16_byte_aligned_whatever_the_token_count(runner: ModelRunner) -> None:
    """Triton specializes kernels on pointer alignment: an odd token count must not shift the
    arrays after the tokens off 16 bytes (that compiled new kernel variants mid-serving)."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, list(range(3 + 2 * i, 8 + 3 * i))) for i in range(3)]  # 5 + 6 + 7 = 18 tokens
    inputs = runner.sequences.prepare(StepPlan(0, [builder.schedule(s) for s in seqs]))
    m = inputs.metadata
    arrays = {"input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": m.slot_mapping,
              "cu_seqlens_q": m.cu_seqlens_q, "cu_seqlens_k": m.cu_seqlens_k, "context_lens": m.context_lens,
              "block_tables": m.block_tables, "sample_indices": inputs.sample_indices,
              "sample_rows": inputs.sample_rows}
    assert inputs.input_ids.shape[0] == 18
    misaligned = {name: t.data_ptr() % 16 for name, t in arrays.items() if t.data_ptr() % 16}
    assert not misaligned, misaligned
    runner.reset()


def test_graph_buffers_have_the_dtypes_of_step_inputs(runner: ModelRunner) -> None:
    """The compiled kernels guard on dtype: graph capture (and the warm-up) must feed what steps
    feed, or the first real step recompiles inside a request's time."""
    from twinplane.dataplane.cuda_graphs import StepGraphs

    runner.reset()
    builder = PlanBuilder(BLOCK)
    inputs = runner.sequences.prepare(StepPlan(0, [builder.schedule(builder.new_seq(1, [1, 2, 3]))]))
    graphs = StepGraphs(model=None, hidden_size=8, dtype=torch.float32, device=torch.device("cpu"), max_num_seqs=8,
                        max_model_len=64, block_size=BLOCK, max_num_batched_tokens=64, mixed=True)
    m = inputs.metadata
    pairs = [(graphs.input_ids, inputs.input_ids), (graphs.positions, inputs.positions),
             (graphs.slot_mapping, m.slot_mapping), (graphs.cu_seqlens_q, m.cu_seqlens_q),
             (graphs.context_lens, m.context_lens), (graphs.block_tables, m.block_tables)]
    assert [buffer.dtype for buffer, _ in pairs] == [step.dtype for _, step in pairs]
    runner.reset()


def test_decode_steps_list_the_longest_context_first(runner: ModelRunner) -> None:
    """The decode kernel starts sequences in ``decode_order``: longest context first (ties in plan
    order); steps with prompt tokens carry none. A CUDA graph's padding rows follow the real ones."""
    from twinplane.dataplane.cuda_graphs import StepGraphs

    runner.reset()
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, [5] * n) for i, n in enumerate([3, 9, 5, 9, 1])]
    prompt = runner.sequences.prepare(StepPlan(0, [builder.schedule(s) for s in seqs]))
    assert prompt.metadata.decode_order is None
    for s in seqs:
        s.tokens.append(7)
    decode = runner.sequences.prepare(StepPlan(1, [builder.schedule(s) for s in seqs]))
    order = decode.metadata.decode_order
    assert order.dtype == torch.int32 and order.tolist() == [1, 3, 2, 0, 4]

    class Replay:
        def replay(self) -> None:
            pass

    graphs = StepGraphs(model=None, hidden_size=8, dtype=torch.float32, device=torch.device("cpu"), max_num_seqs=8,
                        max_model_len=64, block_size=BLOCK, max_num_batched_tokens=64, mixed=True)
    graphs.graphs[(8, 8)] = Replay()
    graphs.decode_order.fill_(0)  # left over from an earlier step
    graphs.run((8, 8), decode.input_ids, decode.positions, decode.metadata)
    assert graphs.decode_order.tolist() == [1, 3, 2, 0, 4, 5, 6, 7]
    assert graphs._metadata(8, 8, [1] * 8).decode_order.data_ptr() == graphs.decode_order.data_ptr()
    assert graphs._metadata(8, 16, [2] * 8).decode_order is None
    runner.reset()


def test_step_output_reports_the_launch_host_time(runner: ModelRunner) -> None:
    """launch_us covers the whole launch (prepare_us is its first part) and crosses the wire."""
    from twinplane.controlplane.plan_codec import decode_result
    from twinplane.dataplane.convert import output_to_pb
    from twinplane.proto import dataplane_pb2 as dp

    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0))
    out = runner.step(StepPlan(1, [builder.schedule(seq)]))
    assert out.launch_us > 0 and out.launch_us >= out.prepare_us
    wire = decode_result(dp.StepResult.FromString(output_to_pb(out).SerializeToString()))
    assert (wire.launch_us, wire.prepare_us) == (out.launch_us, out.prepare_us)


def test_decode_profile_lists_the_step_operators(runner: ModelRunner) -> None:
    """`bench_decode --profile` on a CPU device: a step's operators by their time, the matmuls among
    them nine times a step (q/k/v, o, gate/up and down of two layers, and the LM head), and the
    runner left empty; with ``prompts`` the same for steps that prefill two sequences (the LM head
    on their last tokens only)."""
    from twinplane.dataplane.bench_decode import profile_decode

    runner.reset()
    for kind in ("decode", "prompt"):
        table = profile_decode(runner, batch=2, context=8, steps=4, top=40, prompts=kind == "prompt").splitlines()
        assert table[0].startswith(f"{kind} batch 2, context 8: step ") and "operators (own CPU time)" in table[0]
        rows = {line.split()[-1]: float(line.split()[2]) for line in table[1:]}
        assert "aten::mm" in rows, table
        assert rows["aten::mm"] == runner.loaded.hf_config.num_hidden_layers * 4 + 1, (kind, table)
        assert len(runner.sequences) == 0


def test_decode_plans_time_the_device_and_the_host_of_plans_of_several_steps(runner: ModelRunner) -> None:
    """`bench_decode --plan-steps` on a CPU device: each plan advances every sequence by its steps,
    and a plan's host launch is part of its wall clock."""
    from twinplane.dataplane.bench_decode import DecodeBatch, time_plans

    runner.reset()
    decoding = DecodeBatch(runner, batch=2, context=8, steps=12)
    results = decoding.decode_plans(3, num_steps=4)
    assert [seq[1] for seq in decoding.seqs] == [8 + 12, 8 + 12]
    assert all(0 < launch_us <= wall * 1e6 and device_us > 0 for device_us, launch_us, wall in results)
    runner.reset()
    line = time_plans(runner, batch=1, context=8, num_steps=4, plans=3)
    assert line.startswith("batch 1, context 8, plans of 4 steps: per token ") and line.endswith(" us wall")
    assert len(runner.sequences) == 0


def test_step_spans_split_kernels_into_steps_and_count_overlaps_once() -> None:
    """Two steps 1 ms apart; in the first, two kernels overlap (a launch that starts early) and one
    follows after a 5 us gap: its span is 40 us, 35 of them busy."""
    from twinplane.dataplane.bench_decode import step_spans

    kernels = [(0.0, 20.0), (10.0, 25.0), (30.0, 40.0), (1040.0, 1050.0), (1050.0, 1052.0)]
    assert step_spans(kernels) == [(40.0, 35.0, 3), (12.0, 12.0, 2)]
    assert step_spans(kernels, step_gap_us=2000.0) == [(1052.0, 47.0, 5)]
    assert step_spans([]) == []


def _only(token_id: int) -> bytes:
    """A token mask (49,152 tokens) that allows token_id alone."""
    mask = bytearray(6144)
    mask[token_id // 8] |= 1 << token_id % 8
    return bytes(mask)


def test_a_plan_whose_masks_follow_runs_its_forward_pass_and_samples_once_they_come(runner: ModelRunner) -> None:
    """Structured output planned ahead: a masked sequence decodes its PENDING token in a plan whose masks
    follow; the plan's forward pass is queued at once, its sampling once the masks come, and no other
    plan may come between. Masks for another step, or that break the plan's rules, are refused; a step
    whose masks are refused fails, and the runner takes the next plan."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    free, masked = builder.new_seq(1, [3, 4, 5]), builder.new_seq(2, [6, 7], SamplingParams(masked=True))
    first = StepPlan(1, [builder.schedule(free), builder.schedule(masked)])
    first.cols().token_masks = {1: _only(1000)}
    launched = runner.launch(first)
    for seq in (free, masked):
        seq.tokens.append(-1)  # PENDING: planned before the first step's tokens are read
    ahead = StepPlan(2, [builder.schedule(free), builder.schedule(masked)], masks_follow=True)
    waiting = runner.launch(ahead)
    assert runner.awaits_masks
    with pytest.raises(ValueError, match="step 2 waits for its token masks; no plan may come before them"):
        runner.launch(StepPlan(3, []))
    tokens = launched.result().sampled_token_ids.tolist()
    assert tokens[1] == 1000  # the first plan's own mask
    with pytest.raises(ValueError, match="token masks for step 7, but the step waiting for masks is 2"):
        runner.sample_with_masks(7, {1: _only(2000)})
    assert runner.sample_with_masks(2, {1: _only(2000)}) is waiting and not runner.awaits_masks
    assert waiting.result().sampled_token_ids.tolist()[1] == 2000
    for seq in (free, masked):
        seq.tokens[-1:] = [-1, -1]  # the second step's tokens are PENDING for the third
    third = StepPlan(3, [builder.schedule(free), builder.schedule(masked)], masks_follow=True)
    runner.launch(third)
    with pytest.raises(ValueError, match=r"wanted one for each sampled sequence with a masked sampler, \[1\]"):
        runner.sample_with_masks(3, {0: _only(5)})
    assert not runner.awaits_masks
    free.tokens.append(-1)
    with pytest.raises(ValueError, match="pending"):  # the failed step sampled nothing a PENDING could stand for
        runner.step(StepPlan(4, [builder.schedule(free)]))
    out = runner.step(StepPlan(5, [], dropped_seq_ids=[1, 2]))  # the failed step's sequences are dropped
    assert len(out.sampled_token_ids) == 0 and not runner.sequences.mirrors
    with pytest.raises(ValueError, match="carries no masks itself"):
        bad = StepPlan(6, [builder.schedule(builder.new_seq(3, [1, 2], SamplingParams(masked=True)))],
                       masks_follow=True)
        bad.cols().token_masks = {0: _only(5)}
        runner.launch(bad)


def test_rows_plain_but_for_their_masks_get_their_sampling_built_at_once(runner: ModelRunner, monkeypatch) -> None:
    """Structured output's usual rows (temperature, top-k, top-p, min-p and a mask) beside plain ones get their
    sampling batch built at once from the rows' values, no row at a time: the batch a row-by-row build gives.
    A masked row with a seed is still built row by row."""
    from twinplane.dataplane import input_batch
    from twinplane.dataplane.sampling_batch import SamplingRow, build_sampling_batch

    runner.reset()
    builder, empty = PlanBuilder(BLOCK), np.empty(0, np.int32)
    kinds = [SamplingParams(temperature=0.0, masked=True), SamplingParams(temperature=0.9),
             SamplingParams(temperature=0.7, top_k=5, masked=True), SamplingParams(temperature=0.0, masked=True)]
    masks = [_only(1000), None, _only(2000), _only(1000)]
    plan = StepPlan(1, [builder.schedule(builder.new_seq(i, [3, 4, 5], p)) for i, p in enumerate(kinds)])
    plan.cols().token_masks = {i: m for i, m in enumerate(masks) if m is not None}
    plan.cols().token_masks[3] = plan.cols().token_masks[0]  # a mask two rows share (TokenMask.same_as)
    built = []
    monkeypatch.setattr(input_batch, "build_sampling_batch", lambda *a: built.append(a) or build_sampling_batch(*a))
    got = runner.sequences.prepare(plan, graphs=False).sampling
    assert not built, "built row by row"
    rows = [SamplingRow(p, 0, empty, empty, plan.cols().token_masks.get(i)) for i, p in enumerate(kinds)]
    want = build_sampling_batch(rows, runner.vocab_size, runner.device)
    for name in ("num_rows", "all_greedy", "seeded", "num_logprobs", "penalties", "banned", "bias", "top_p", "min_p"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("greedy", "temperature", "top_k"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.masks.index.tolist() == want.masks.index.tolist() == [0, -1, 1, 0]
    assert torch.equal(got.masks.packed, want.masks.packed)
    seeded = builder.new_seq(9, [3, 4], SamplingParams(temperature=0.5, seed=3, masked=True))
    plan = StepPlan(2, [builder.schedule(seeded)])
    plan.cols().token_masks = {0: _only(7)}
    assert runner.sequences.prepare(plan, graphs=False).sampling.seeded == [(0, 3, 0)] and len(built) == 1
    runner.reset()


def test_a_plan_refused_as_it_is_read_still_drops_what_it_drops(runner: ModelRunner) -> None:
    """The data plane's edge: a plan whose columns disagree is refused before the runner sees it; the
    sequences it drops (ended on the control plane) are dropped all the same, so their rows are free."""
    from twinplane.dataplane.server import DataPlaneServicer
    from twinplane.proto import dataplane_pb2 as dp

    runner.reset()
    builder = PlanBuilder(BLOCK)
    runner.step(StepPlan(1, [builder.schedule(builder.new_seq(7, [3, 4, 5]))]))
    assert set(runner.sequences.mirrors) == {7}
    bad = dp.StepPlan(step_id=2, seq_ids=np.array([8], "<i8").tobytes(), dropped_seq_ids=[7])  # no other column
    result = DataPlaneServicer(runner)._launch(bad)
    assert "plan columns disagree" in result.error
    assert not runner.sequences.mirrors


def test_logit_bias_ids_and_values_of_other_lengths_are_refused() -> None:
    from twinplane.dataplane.convert import init_from_pb
    from twinplane.proto import dataplane_pb2 as dp

    init = dp.SequenceInit(seq_id=4, num_prompt_tokens=2)
    init.sampling.logit_bias_ids.extend([3, 5])
    init.sampling.logit_bias_values.append(1.0)
    with pytest.raises(ValueError, match="seq 4: 2 logit_bias_ids for 1 logit_bias_values"):
        init_from_pb(init)


NAN = float("nan")


@pytest.mark.parametrize("name, allowed, refused, message", [
    ("min_p", [0.0, 1.0], [-1e-6, 1.000001, NAN], r"min_p \S+ not in \[0, 1\]"),
    ("top_p", [1e-6, 1.0], [0.0, -0.5, 1.000001, NAN], r"top_p \S+ not in \(0, 1\]"),
    ("repetition_penalty", [1e-6, 1.0, 100.0], [0.0, -1.0], r"repetition_penalty \S+ <= 0"),
    ("stop_token_ids", [(0,), (49151,), (0, 49151)], [(-1,), (49152,), (5, 49152)],
     "stop_token_ids outside the vocabulary"),
])
def test_sampling_bounds_of_a_sequence_init(runner: ModelRunner, name: str, allowed, refused, message: str) -> None:
    """A SequenceInit's sampling fields are taken up to their bounds and refused just past them, the error
    naming the field: min_p in [0, 1], top_p in (0, 1], repetition_penalty > 0, stop ids in the vocabulary."""
    from twinplane.dataplane.input_batch import check_sampling

    limits = runner.sequences.limits
    for value in allowed:
        check_sampling(4, SequenceInit(SamplingParams(**{name: value}), 2), limits)
    for value in refused:
        with pytest.raises(ValueError, match=f"seq 4: {message}"):
            check_sampling(4, SequenceInit(SamplingParams(**{name: value}), 2), limits)


def test_sampling_at_the_bounds_runs_and_samples_as_they_say(runner: ModelRunner) -> None:
    """Inits at the edge values pass a plan's checks and sample: min_p 1 and the smallest top_p keep the
    most likely token alone (the greedy one), a tiny repetition_penalty runs, and stop ids at both ends of
    the vocabulary are masked below min_tokens (without them, a bias makes those ends the greedy tokens)."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    ends = (0, 49151)
    bias = tuple((t, 100.0) for t in ends)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, min_p=1.0, seed=1),
             SamplingParams(temperature=1.0, top_p=1e-6, seed=2),
             SamplingParams(temperature=0.0, repetition_penalty=1e-6),
             SamplingParams(temperature=0.0, logit_bias=bias),
             SamplingParams(temperature=0.0, logit_bias=bias, min_tokens=2, stop_token_ids=ends)]
    seqs = [builder.new_seq(i, [10, 11, 12], p) for i, p in enumerate(kinds)]
    out = runner.step(StepPlan(1, [builder.schedule(s) for s in seqs])).sampled_token_ids.tolist()
    greedy, min_p, top_p, _, biased, stopped = out
    assert min_p == top_p == greedy and biased in ends and stopped not in ends
    assert len(runner.sequences) == 6
    runner.reset()


PENALIZED = SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.5)  # reads the token history
PROMPT = [10, 11, 12, 13, 14]


def _decode(runner: ModelRunner, builder: PlanBuilder, seq, steps: int, first_step: int = 1) -> None:
    """Runs ``steps`` plans of ``seq`` alone (its prompt first, if not computed yet), keeping its tokens."""
    for step in range(first_step, first_step + steps):
        seq.tokens.append(int(runner.step(StepPlan(step, [builder.schedule(seq)])).sampled_token_ids[0]))


def _unbroken(runner: ModelRunner, steps: int) -> list[int]:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seq = builder.new_seq(1, PROMPT, PENALIZED)
    _decode(runner, builder, seq, steps)
    runner.reset()
    return seq.tokens


def _from_scratch(builder: PlanBuilder, seq, sampling: SamplingParams = PENALIZED):
    """``seq`` sent again with a SequenceInit, its prompt and outputs to compute in new blocks."""
    again = builder.new_seq(seq.seq_id, seq.tokens[:seq.num_prompt_tokens], sampling)
    again.tokens = list(seq.tokens)
    return again


def test_a_refused_plan_that_sends_a_held_sequence_again_keeps_its_old_row(runner: ModelRunner) -> None:
    """A held sequence sent again from scratch (a SequenceInit, as after a preemption) in a plan that is then
    refused keeps its row, block table, history and sampling: it decodes on as if that plan never came. Sent
    again in a plan that runs, it starts over in a new row and its old row is freed."""
    unbroken = _unbroken(runner, 9)
    builder, batch = PlanBuilder(BLOCK), runner.sequences
    seq = builder.new_seq(1, PROMPT, PENALIZED)
    _decode(runner, builder, seq, 4)
    row, free = batch.row_of[1], len(batch.free_rows)
    table = batch.block_table[row, :batch.num_blocks[row]].tolist()
    again = builder.schedule(_from_scratch(builder, seq, SamplingParams(temperature=0.0)))
    other = builder.schedule(builder.new_seq(2, [3, 4]))
    with pytest.raises(ValueError, match="slot_mapping disagrees"):  # found once both have rows
        runner.step(StepPlan(10, [again, dataclasses.replace(other, slot_mapping=other.slot_mapping + 1)]))
    assert batch.row_of == {1: row} and len(batch.free_rows) == free and batch.owner[row] == 1
    assert batch.params[row] == PENALIZED and batch.block_table[row, :batch.num_blocks[row]].tolist() == table
    _decode(runner, builder, seq, 4, first_step=11)
    assert seq.tokens == unbroken[:-1]
    again = _from_scratch(builder, seq)
    _decode(runner, builder, again, 1, first_step=20)
    assert again.tokens == unbroken and batch.row_of[1] != row and len(batch.free_rows) == free


def test_a_plan_may_drop_a_sequence_and_send_it_again_from_scratch(runner: ModelRunner) -> None:
    """dropped_seq_ids and a SequenceInit for the same seq_id in one plan: the drop comes first, and the
    sequence, computed again from its prompt and outputs, samples what it would have sampled unbroken.
    In a plan that is refused, the drop holds and the new init is not kept."""
    unbroken = _unbroken(runner, 8)
    builder, batch = PlanBuilder(BLOCK), runner.sequences
    seq = builder.new_seq(1, PROMPT, PENALIZED)
    _decode(runner, builder, seq, 4)
    free = len(batch.free_rows)
    again = _from_scratch(builder, seq)
    out = runner.step(StepPlan(10, [builder.schedule(again)], dropped_seq_ids=[1]))
    again.tokens.append(int(out.sampled_token_ids[0]))
    assert set(batch.mirrors) == {1} and len(batch.free_rows) == free  # the old row freed, a new one taken
    _decode(runner, builder, again, 3, first_step=11)
    assert again.tokens == unbroken
    refused = builder.schedule(_from_scratch(builder, again))
    with pytest.raises(ValueError, match="slot_mapping disagrees"):
        runner.step(StepPlan(20, [dataclasses.replace(refused, slot_mapping=refused.slot_mapping + 1)],
                             dropped_seq_ids=[1]))
    assert not batch.mirrors and len(batch.free_rows) == free + 1


def test_reset_while_a_step_waits_for_its_token_masks_lets_the_runner_take_plans(runner: ModelRunner) -> None:
    """reset() (a control plane that reconnects) while a launched plan waits for its token masks: nothing waits
    any more, the forgotten step's masks are refused, and the runner takes the next plan."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    masked = builder.new_seq(2, [6, 7], SamplingParams(temperature=0.0, masked=True))
    runner.launch(StepPlan(1, [builder.schedule(masked)], masks_follow=True))
    assert runner.awaits_masks
    runner.reset()
    assert not runner.awaits_masks and not runner.sequences.mirrors
    with pytest.raises(ValueError, match="token masks for step 1, but the step waiting for masks is None"):
        runner.sample_with_masks(1, {0: _only(5)})
    fresh = builder.new_seq(3, [1, 2, 3])
    assert runner.step(StepPlan(2, [builder.schedule(fresh)])).sampled_token_ids.shape == (1,)
    runner.reset()


def _plan_pb(plan: StepPlan):
    """A plan as the control plane sends it (inits with temperature, top-p and masked only)."""
    from twinplane.proto import dataplane_pb2 as dp

    c = plan.cols()
    inits = [dp.SequenceInit(seq_id=seq_id, num_prompt_tokens=init.num_prompt_tokens, sampling=dp.SamplingParams(
        temperature=init.sampling.temperature, top_p=1.0, repetition_penalty=1.0, num_logprobs=-1,
        masked=init.sampling.masked)) for seq_id, init in c.inits.items()]
    packed = {name: getattr(c, name).astype("<i4").tobytes() for name in
              ("num_tokens", "start_pos", "token_ids", "slot_mapping", "num_new_blocks", "new_block_ids")}
    return dp.StepPlan(step_id=plan.step_id, seq_ids=c.seq_ids.astype("<i8").tobytes(),
                       sample=c.sample.astype(np.uint8).tobytes(), **packed,
                       inits=inits, dropped_seq_ids=plan.dropped_seq_ids, masks_follow=plan.masks_follow)


class _StepStream:
    """A Step stream to a data-plane server, fed one plan at a time."""

    def __init__(self, stub) -> None:
        import queue

        self.plans = queue.SimpleQueue()
        self.call = stub.Step(iter(self.plans.get, None), timeout=30)

    def step(self, plan: StepPlan):
        """Sends a plan and returns the next result."""
        self.plans.put(_plan_pb(plan))
        return next(self.call)

    def close(self) -> list:
        """Ends the stream; returns the results still due."""
        self.plans.put(None)
        return list(self.call)


@pytest.fixture
def dataplane_stub(runner: ModelRunner, tmp_path):
    """A data-plane gRPC server over the module's runner, on a unix socket; its stub."""
    import grpc
    from twinplane.dataplane.server import create_server
    from twinplane.proto import dataplane_pb2_grpc as dp_grpc

    address = f"unix://{tmp_path}/dp.sock"
    server, _, _ = create_server(runner, address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            yield dp_grpc.DataPlaneStub(channel)
    finally:
        server.stop(0)  # not the servicer's close(): it would release the module's runner
        runner.reset()


def test_a_new_step_stream_forgets_the_sequences_of_the_one_before(runner: ModelRunner, dataplane_stub) -> None:
    """A new Step stream starts the data plane afresh: a sequence of the stream before is unknown (its decode
    plan, without a SequenceInit, fails), and the new stream's own sequences run. So does a Reset."""
    from twinplane.proto import dataplane_pb2 as dp

    runner.reset()
    builder = PlanBuilder(BLOCK)
    held = builder.new_seq(7, [3, 4, 5])
    first = _StepStream(dataplane_stub)
    result = first.step(StepPlan(1, [builder.schedule(held)]))
    assert not result.error and len(result.sampled_token_ids) == 4
    held.tokens.append(int(np.frombuffer(result.sampled_token_ids, "<i4")[0]))
    assert first.close() == [] and set(runner.sequences.mirrors) == {7}
    second = _StepStream(dataplane_stub)
    assert "seq 7: unknown to the data plane" in second.step(StepPlan(2, [builder.schedule(held)])).error
    assert not runner.sequences.mirrors
    result = second.step(StepPlan(3, [builder.schedule(builder.new_seq(8, [1, 2, 3]))]))
    assert not result.error and set(runner.sequences.mirrors) == {8}
    second.close()
    dataplane_stub.Reset(dp.ResetRequest(), timeout=30)
    assert not runner.sequences.mirrors


def test_a_step_stream_that_ends_while_its_plan_waits_for_masks_leaves_the_next_stream_free(
        runner: ModelRunner, dataplane_stub) -> None:
    """A Step stream that ends with its last plan still waiting for its token masks (a control plane gone
    mid-step) leaves the runner waiting; the next stream's reset lets its plans run."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    masked = builder.new_seq(2, [6, 7], SamplingParams(temperature=0.0, masked=True))
    first = _StepStream(dataplane_stub)
    first.plans.put(_plan_pb(StepPlan(1, [builder.schedule(masked)], masks_follow=True)))
    first.close()
    assert runner.awaits_masks
    second = _StepStream(dataplane_stub)
    result = second.step(StepPlan(2, [builder.schedule(builder.new_seq(3, [1, 2, 3]))]))
    assert not result.error and len(result.sampled_token_ids) == 4
    assert not runner.awaits_masks and set(runner.sequences.mirrors) == {3}
    second.close()


def test_a_step_message_that_is_no_plan_ends_its_stream_and_the_server_still_stops(runner: ModelRunner,
                                                                                   tmp_path) -> None:
    """Bytes on a Step stream that do not parse as a StepPlan end that stream with INVALID_ARGUMENT saying
    which message, after the results due; the next stream is served, and the server still stops (left to
    grpc, the parse failure of a streaming call's message kept the server from stopping: the data plane never
    exited on SIGTERM)."""
    import grpc
    from twinplane.dataplane.server import create_server
    from twinplane.proto import dataplane_pb2 as dp
    from twinplane.proto import dataplane_pb2_grpc as dp_grpc

    runner.reset()
    address = f"unix://{tmp_path}/dp.sock"
    server, _, _ = create_server(runner, address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            raw = channel.stream_stream("/twinplane.dataplane.v1.DataPlane/Step", request_serializer=bytes,
                                        response_deserializer=dp.StepResult.FromString)
            builder = PlanBuilder(BLOCK)
            for attempt in range(10):  # the odd ones after a plan, whose result comes first
                results = []
                plans = [_plan_pb(StepPlan(attempt, [builder.schedule(builder.new_seq(attempt, [3, 4, 5]))]))
                         .SerializeToString()] if attempt % 2 else []
                with pytest.raises(grpc.RpcError) as ended:
                    for result in raw(iter([*plans, b"\xff" * 40]), timeout=30):
                        results.append(result)
                assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert ended.value.details().startswith(f"message {len(plans) + 1} of the Step stream is no StepPlan")
                assert [(r.step_id, r.error, len(r.sampled_token_ids)) for r in results] == \
                    [(attempt, "", 4)] * len(plans)
            stream = _StepStream(dp_grpc.DataPlaneStub(channel))
            assert not stream.step(StepPlan(20, [builder.schedule(builder.new_seq(20, [1, 2]))])).error
            stream.close()
    finally:
        assert server.stop(0.5).wait(15), "the server did not stop"
        runner.reset()

