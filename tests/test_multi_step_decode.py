"""Plans of several decode steps: the data plane feeds each step's tokens into the next one,
and the control plane plans them for small decode-only batches."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_dp_helpers import PlanBuilder
from tests.test_e2e_reference import random_prompts
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.plan import SamplingParams, StepPath, StepPlan

BLOCK = 4
PROMPTS = {1: [10, 11, 12, 13, 14], 2: [3, 4, 5], 3: [7, 8, 9, 10, 11, 12, 13]}


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    """A model whose greedy tokens vary (random untied weights): a token fed back wrong shows."""
    return ModelRunner(DataPlaneConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=64,
                                       max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64))


def _one_at_a_time(runner: ModelRunner, num_tokens: int) -> dict[int, list[int]]:
    """Greedy outputs of PROMPTS, one decode step per plan."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, prompt) for i, prompt in PROMPTS.items()]
    for step in range(num_tokens):
        out = runner.step(StepPlan(step, [builder.schedule(s) for s in seqs]))
        for s, token in zip(seqs, out.sampled_token_ids.tolist()):
            s.tokens.append(token)
    return {s.seq_id: s.tokens[len(PROMPTS[s.seq_id]):] for s in seqs}


def test_several_decode_steps_give_the_tokens_of_single_steps(runner: ModelRunner) -> None:
    expected = _one_at_a_time(runner, 12)
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, prompt) for i, prompt in PROMPTS.items()]
    out = runner.step(StepPlan(0, [builder.schedule(s) for s in seqs]))  # prefill
    for s, token in zip(seqs, out.sampled_token_ids.tolist()):
        s.tokens.append(token)
    # budgets differ per sequence; blocks are crossed inside the plan (block size 4)
    budgets = [4, 1, 3]
    out = runner.step(StepPlan(1, [builder.schedule(s, decode_budget=b) for s, b in zip(seqs, budgets)],
                               num_steps=4))
    assert out.path is StepPath.MULTI_DECODE
    assert len(out.sampled_token_ids) == sum(budgets)
    for s, part in zip(seqs, np.split(out.sampled_token_ids, np.cumsum(budgets)[:-1])):
        s.tokens += part.tolist()
    # the next plan goes out before this one's tokens are read: PENDING is each sequence's last token
    launched = []
    for step, budget in ((2, 3), (3, 4)):
        scheduled = [builder.schedule(s, decode_budget=budget) for s in seqs]  # step 3: its one token is -1
        launched.append((runner.launch(StepPlan(step, scheduled, num_steps=budget)), budget))
        for s in seqs:
            s.tokens += [-1] * budget
    for step, budget in launched:
        tokens = step.result().sampled_token_ids.reshape(len(seqs), budget)
        for s, row in zip(seqs, tokens.tolist()):
            first = s.tokens.index(-1)
            s.tokens[first:first + budget] = row
    got = {s.seq_id: s.tokens[len(PROMPTS[s.seq_id]):] for s in seqs}
    for seq_id, tokens in got.items():
        assert tokens == expected[seq_id][:len(tokens)], f"seq {seq_id}"
        assert len(set(tokens)) > len(tokens) // 2, "the model should not just repeat a token"
    assert [len(t) for t in got.values()] == [1 + 4 + 3 + 4, 1 + 1 + 3 + 4, 1 + 3 + 3 + 4]


def _bad_multi_plans(builder: PlanBuilder, runner: ModelRunner) -> dict[str, StepPlan]:
    plain, penalized = builder.new_seq(1, [1, 2, 3]), builder.new_seq(2, [4, 5], SamplingParams(
        temperature=0.0, repetition_penalty=1.2))
    out = runner.step(StepPlan(0, [builder.schedule(plain), builder.schedule(penalized)]))
    plain.tokens.append(int(out.sampled_token_ids[0]))
    penalized.tokens.append(int(out.sampled_token_ids[1]))

    def multi(seq, budget=2, num_steps=2, **changes) -> StepPlan:
        snapshot = dataclasses.replace(seq, blocks=list(seq.blocks))
        scheduled = dataclasses.replace(builder.schedule(snapshot, decode_budget=budget), **changes)
        return StepPlan(1, [scheduled], num_steps=num_steps)

    fresh = builder.new_seq(3, [6, 7])
    return {
        "penalties": multi(penalized),
        "budget above num_steps": multi(plain, budget=3, num_steps=2),
        "budget zero": multi(plain, decode_budget=0),
        "prefill": StepPlan(1, [dataclasses.replace(builder.schedule(fresh), decode_budget=2)], num_steps=2),
        "blocks": multi(plain, budget=2, new_block_ids=np.empty(0, np.int32)),
        "too many steps": multi(plain, budget=2, num_steps=65),
    }


@pytest.mark.parametrize("case, match", [
    ("penalties", "no penalties"), ("budget above num_steps", "decode_budget must be in"),
    ("budget zero", "decode_budget must be in"), ("prefill", "computes one token"),
    ("blocks", "does not cover"), ("too many steps", "at most 64")])
def test_bad_plans_of_several_steps_fail_the_step_not_the_runner(runner: ModelRunner, case: str, match: str) -> None:
    runner.reset()
    builder = PlanBuilder(BLOCK)
    plan = _bad_multi_plans(builder, runner)[case]
    with pytest.raises(ValueError, match=match):
        runner.step(plan)
    good = builder.new_seq(9, [5, 6, 7])
    assert runner.step(StepPlan(5, [builder.schedule(good)])).sampled_token_ids.shape == (1,)


# ---- the control plane's side ------------------------------------------------------------

from twinplane.controlplane.block_manager import BlockManager  # noqa: E402
from twinplane.controlplane.plan_codec import encode_plan  # noqa: E402
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from twinplane.controlplane.sequence import PENDING, RequestParams, SamplingOptions, Sequence  # noqa: E402


def _scheduler(decode_steps: int = 4, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                             decode_steps=decode_steps, decode_steps_max_seqs=4)
    return Scheduler(config, BlockManager(num_blocks, 4))


def _decoding(sched: Scheduler, *max_tokens: int, params: RequestParams | None = None) -> list[Sequence]:
    """Sequences of 3 prompt tokens, prefilled, each with its first token back."""
    seqs = [Sequence(i, str(i), [1, 2, 3], params or RequestParams(max_tokens=m)) for i, m in enumerate(max_tokens)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    sched.update(out, [9] * len(seqs))
    return seqs


def test_small_decode_batches_get_several_steps_with_budgets_and_blocks() -> None:
    sched = _scheduler()
    a, b = _decoding(sched, 10, 3)
    out = sched.schedule()
    assert out.num_steps == 4 and out.decode_budget == [4, 2]  # b may make only 2 more tokens
    assert [s.seq_id for s in out.seqs] == [0, 1] and out.num_batched_tokens == 6
    # positions 3..6 of a are written in this plan: its table covers them (block size 4)
    assert len(a.block_table) == 2 and a.num_computed_tokens == 7 and a.token_ids[4:] == [PENDING] * 4
    plan = encode_plan(out, 4, (2,))
    assert plan.num_steps == 4 and np.frombuffer(plan.decode_budget, "<i4").tolist() == [4, 2]
    # the data plane returns each sequence's budget, a first; b stopped at a stop token (5) inside it
    appended = sched.update(out, [11, 12, 13, 14, 5, 21])
    assert [(s.seq_id, t, pos) for s, t, _, pos in appended] == [
        (0, 11, 4), (0, 12, 5), (0, 13, 6), (0, 14, 7), (1, 5, 4), (1, 21, 5)]
    assert a.token_ids[3:] == [9, 11, 12, 13, 14]


def test_one_step_per_plan_while_anything_waits_or_sampling_needs_the_host() -> None:
    sched = _scheduler()
    _decoding(sched, 10, 10)
    sched.add(Sequence(5, "5", [4, 5, 6], RequestParams(max_tokens=10)))
    assert sched.schedule().num_steps == 1  # admitting the newcomer comes first
    penalized = RequestParams(max_tokens=10, sampling=SamplingOptions(temperature=0.0, repetition_penalty=1.2))
    sched = _scheduler()
    _decoding(sched, 0, params=penalized)
    assert sched.schedule().num_steps == 1
    sched = _scheduler()
    _decoding(sched, *[10] * 5)  # more sequences than decode_steps_max_seqs
    assert sched.schedule().num_steps == 1
    sched = _scheduler(num_blocks=2)  # no blocks for the budget: one step (which may preempt)
    _decoding(sched, 10, 10)
    assert sched.schedule().num_steps == 1


def test_the_next_plan_continues_from_pending_tokens() -> None:
    """Planned before the previous plan's result: the last PENDING token is the input, and
    max_tokens counts the tokens still in flight."""
    sched = _scheduler()
    (a,) = _decoding(sched, 7)
    first = sched.schedule()
    second = sched.schedule()
    assert first.decode_budget == [4] and second.decode_budget == [2]  # 1 + 4 + 2 = max_tokens 7
    assert [c.start_pos for c in second.chunks] == [7]
    assert sched.schedule() is None  # its last token is in flight; the result ends it
    sched.update(first, [11, 12, 13, 14])
    sched.update(second, [15, 16])
    assert a.token_ids[3:] == [9, 11, 12, 13, 14, 15, 16] and a.num_output_tokens == 7


def _generate_all(planes, requests: list[dict]) -> list[tuple[list[int], str]]:
    """Every request at once; each one's tokens and finish reason."""
    def one(kwargs: dict) -> tuple[list[int], str]:
        tokens, reason = [], ""
        for chunk in client.generate(temperature=0, **kwargs):
            tokens += list(chunk.token_ids)
            reason = chunk.finish_reason or reason
        return tokens, reason

    with planes.client() as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_greedy_outputs_do_not_change_with_several_decode_steps(tiny_llama_dir, planes_factory) -> None:
    """Through both planes: the same tokens and finish reasons, stop tokens inside a plan included."""
    prompts = random_prompts(5, seed=7)
    requests = [dict(token_ids=p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, (5, 13, 20, 9, 1))]
    single = planes_factory(tiny_llama_dir, "--block-size", "16", decode_steps=1)
    expected = _generate_all(single, requests)
    # a stop token the output meets at its 6th token: inside the first plan of several steps
    stop = expected[2][0][5]
    requests.append(dict(token_ids=prompts[2], max_tokens=20, stop_token_ids=[stop]))
    expected.append(_generate_all(single, requests[-1:])[0])
    assert expected[-1][1] == "stop_token" and len(expected[-1][0]) == expected[2][0].index(stop) + 1
    several = planes_factory(tiny_llama_dir, "--block-size", "16", decode_steps=8)
    assert _generate_all(several, requests) == expected
    for planes, multi in ((single, False), (several, True)):
        with planes.client() as client:
            assert (client.stats()["multi_decode_steps"] > 0) is multi


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_steps=st.integers(0, 70), budgets=st.lists(st.integers(-2, 70), min_size=1, max_size=3),
       start_shift=st.integers(-3, 3), drop_blocks=st.booleans())
def test_random_plans_of_several_steps_run_or_fail_cleanly(runner, num_steps, budgets, start_shift, drop_blocks):
    """Whatever the budgets, step counts, positions and blocks: the step runs and returns each
    sequence's budget of tokens, or fails with ValueError and leaves the runner usable."""
    runner.reset()
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, prompt) for i, prompt in list(PROMPTS.items())[:len(budgets)]]
    out = runner.step(StepPlan(0, [builder.schedule(s) for s in seqs]))
    for s, token in zip(seqs, out.sampled_token_ids.tolist()):
        s.tokens.append(token)
    scheduled = []
    for s, budget in zip(seqs, budgets):
        one = builder.schedule(s, decode_budget=max(budget, 1))
        changes = dict(decode_budget=budget, start_pos=max(one.start_pos + start_shift, 0))
        if drop_blocks:
            changes["new_block_ids"] = np.empty(0, np.int32)
        scheduled.append(dataclasses.replace(one, **changes))
    try:
        result = runner.step(StepPlan(1, scheduled, num_steps=num_steps))
    except ValueError:
        pass
    else:
        expected = sum(budgets) if num_steps > 1 else len(budgets)
        assert len(result.sampled_token_ids) == expected
    good = builder.new_seq(9, [5, 6, 7])
    assert runner.step(StepPlan(2, [builder.schedule(good)])).sampled_token_ids.shape == (1,)


PLAIN_FILTERS = dict(sampling=dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1))


@pytest.mark.parametrize("change", [
    {}, PLAIN_FILTERS, dict(sampling=dict(repetition_penalty=1.1)), dict(sampling=dict(presence_penalty=0.5)),
    dict(sampling=dict(frequency_penalty=-0.5)), dict(sampling=dict(seed=3)), dict(logprobs=0), dict(min_tokens=2),
    dict(logit_bias=((3, 1.0),)), dict(regex="a+"), dict(allowed_token_ids=(1, 2)),
    dict(bad_words=("x",), bad_words_ids=((7,),)),
])
def test_what_the_scheduler_plans_several_steps_for_is_what_the_data_plane_samples_plainly(change):
    """RequestParams.plain_sampling (which the control plane puts in plans of several decode steps) holds
    exactly when the data plane, given the sequence's init, samples it on its plain path (which such a
    plan needs): with temperature, top-k, top-p and min-p only."""
    from twinplane.controlplane.plan_codec import sequence_init
    from twinplane.controlplane.sequence import RequestParams, SamplingOptions, Sequence
    from twinplane.dataplane.convert import init_from_pb
    from twinplane.dataplane.input_batch import _is_plain

    params = RequestParams(max_tokens=8, **{k: v for k, v in change.items() if k != "sampling"},
                           sampling=SamplingOptions(**change.get("sampling", {})))
    seq = Sequence(1, "r", [1, 2, 3], params)
    seq.matcher = object() if params.constrained else None  # the engine core gives a constrained one a matcher
    plain = _is_plain(init_from_pb(sequence_init(seq, (0,), 0)).sampling)
    assert params.plain_sampling == plain == (change in ({}, PLAIN_FILTERS))


def test_a_full_batch_of_the_longest_plans_fits_the_staging_buffer() -> None:
    """Every array a step stages fits the buffer sized from the limits, also where they leave no slack:
    as many sequences as tokens a step, each decoding the most steps a plan may ask for, to max_model_len."""
    import torch

    from twinplane.dataplane.input_batch import InputBatch, PlanLimits
    from twinplane.dataplane.plan import MAX_DECODE_STEPS

    n, block = 256, 16
    batch = InputBatch(PlanLimits(vocab_size=100, num_kv_blocks=n * 8, block_size=block,
                                  max_model_len=1 + MAX_DECODE_STEPS, max_num_seqs=n, max_num_batched_tokens=n,
                                  max_logprobs=0), torch.device("cpu"))
    builder = PlanBuilder(block)
    seqs = [builder.new_seq(i, [i % 100]) for i in range(n)]
    prompts = batch.prepare(StepPlan(0, [builder.schedule(s) for s in seqs]))
    batch.set_last_tokens(prompts.sample_rows, torch.full((n,), 7))
    for s in seqs:
        s.tokens.append(-1)  # PENDING: the token the prompt step sampled
    plan = StepPlan(1, [builder.schedule(s, decode_budget=MAX_DECODE_STEPS) for s in seqs],
                    num_steps=MAX_DECODE_STEPS)
    inputs = batch.prepare(plan)
    assert inputs.decode_steps is not None and inputs.decode_steps.num_steps == MAX_DECODE_STEPS
