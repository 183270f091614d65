"""Model-based test of the control plane's scheduling against a stand-in data plane.

A random schedule of events (requests with shared prefixes, aborts, a lost data plane, and the
ticks of the step loop) drives Scheduler, BlockManager and encode_plan the way the engine core
and a replica's step loop do: schedule, encode, up to max_steps_in_flight plans ahead, update,
finish on a token rule, evict_all and recompute when the data plane is lost. Small KV caches and
token budgets make preemption by recompute and chunked prefill frequent; plans of several decode
steps, prefix caching and the prefill cap with decodes are switched on and off.

The stand-in data plane keeps the paged KV contract exactly: it decodes each StepPlan's columns,
mirrors each sequence's block table from inits, new_block_ids and dropped_seq_ids, checks every
slot against that table, stores (token, position) per KV slot, and samples the next token as a
hash of the context it reads back through the mirrored table. Every emitted token must equal the
same function of the request's true history, so a wrong block table or slot, a prefix-cache hit
on other contents or a wrong recompute changes the output. After every tick, each block's
reference count must equal the live block tables holding it, a block may be shared only as the
same full cached block, and every computed position of a running sequence must hold its token in
the KV cache; at the end every block is free and every request has exactly its tokens.

The data plane's own plan handling runs beside the stand-in, on the CPU and with no model: each
plan is decoded by convert.plan_from_pb and prepared by a real InputBatch, which must accept it,
and what it builds must equal what the stand-in derived: token ids (PENDING resolved), positions,
slots, context lengths and block tables, which rows sample, the tokens masked for min_tokens, the
token counts of requests with a penalty, and each step's positions, slots and context lengths in a
plan of several decode steps. The stand-in's samples go back to it as ModelRunner feeds the
sampler's: kept for the next plan's PENDING tokens, and written into the token history when the
result is read or the next plan waits for them.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import numpy as np
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.finish import stop_token_ids, token_finish_reason
from twinplane.controlplane.plan_codec import decode_result, encode_plan
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import PENDING, FinishReason, RequestParams, SamplingOptions, Sequence
from twinplane.dataplane.convert import plan_from_pb
from twinplane.dataplane.input_batch import DecodeSteps, InputBatch, PlanLimits, StepInputs
from twinplane.proto import dataplane_pb2 as dp

VOCAB = 8  # tiny: prompts share prefixes often, and the end-of-sequence token comes up
EOS_IDS = (0,)
STOP_TOKEN = 3  # some requests stop on it too


def next_token(context: list[int], masked: frozenset[int]) -> int:
    """The stand-in model: a hash of the whole context, stepping past masked tokens."""
    token = zlib.crc32(np.asarray(context, dtype="<i4").tobytes()) % VOCAB
    while token in masked:
        token = (token + 1) % VOCAB
    return token


# ---- the stand-in data plane ----------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What the data plane would describe."""

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class Mirror:
    """What the data plane keeps of a sequence (input_batch.py): block table, sampling, last sample."""

    num_prompt_tokens: int
    min_tokens: int
    masked: frozenset[int]  # while fewer than min_tokens tokens are generated
    penalized: bool  # its sampler counts the tokens of its history
    block_table: list[int] = field(default_factory=list)
    last_token: int = PENDING
    sampled_at: int = -1  # index of the plan that sampled last_token

    def banned(self, context_len: int) -> frozenset[int]:
        """The tokens masked when sampling after context_len tokens."""
        return self.masked if context_len - self.num_prompt_tokens < self.min_tokens else frozenset()


@dataclass
class Row:
    """One sequence's share of a plan."""

    seq_id: int
    mirror: Mirror
    start: int
    tokens: list[int]
    slots: list[int]
    sample: bool
    budget: int  # tokens sampled, in a plan of several decode steps


def column(data: bytes, dtype: str) -> list[int]:
    return np.frombuffer(data, dtype=dtype).tolist()


class StandInDataPlane:
    """Runs StepPlans on a KV cache of (token, position) per slot, as the real data plane would."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.kv: list[tuple[int, int] | None] = [None] * (limits.num_blocks * limits.block_size)
        self.mirrors: dict[int, Mirror] = {}
        self.plan_index = 0

    def slot(self, mirror: Mirror, pos: int) -> int:
        bs = self.limits.block_size
        assert pos // bs < len(mirror.block_table), f"position {pos} is past the mirrored block table"
        return mirror.block_table[pos // bs] * bs + pos % bs

    def run(self, plan: dp.StepPlan) -> tuple[list[Row], list[list[int]]]:
        """Runs a plan: its rows (PENDING tokens resolved) and the tokens each row sampled."""
        self.plan_index += 1
        for seq_id in plan.dropped_seq_ids:
            self.mirrors.pop(seq_id, None)
        rows = self._rows(plan)
        outputs: list[list[int]] = [[] for _ in rows]
        for step in range(max(plan.num_steps, 1)):  # each decode step feeds its samples into the next
            active = [(row, out) for row, out in zip(rows, outputs) if step < row.budget]
            written: set[int] = set()
            for row, out in active:  # every token's K/V first, then attention reads
                if step == 0:
                    tokens, slots = row.tokens, row.slots
                else:
                    tokens, slots = [out[-1]], [self.slot(row.mirror, row.start + step)]
                for pos, (token, slot) in enumerate(zip(tokens, slots), row.start + step):
                    assert slot not in written, f"slot {slot} written twice in one step"
                    written.add(slot)
                    self.kv[slot] = (token, pos)
            for row, out in active:
                if row.sample:
                    out.append(self._sample(row.mirror, row.start + len(row.tokens) + step))
        for row, out in zip(rows, outputs):
            if out:
                row.mirror.last_token, row.mirror.sampled_at = out[-1], self.plan_index
        return rows, outputs

    def _rows(self, plan: dp.StepPlan) -> list[Row]:
        """Decodes and checks the plan's columns; applies inits and new blocks to the mirrors."""
        lim = self.limits
        seq_ids = column(plan.seq_ids, "<i8")
        num_tokens, start_pos = column(plan.num_tokens, "<i4"), column(plan.start_pos, "<i4")
        token_ids, slot_mapping = column(plan.token_ids, "<i4"), column(plan.slot_mapping, "<i4")
        num_new_blocks, new_block_ids = column(plan.num_new_blocks, "<i4"), column(plan.new_block_ids, "<i4")
        sample = column(plan.sample, "u1")
        n = len(seq_ids)
        budgets = column(plan.decode_budget, "<i4") if plan.num_steps > 1 else [1] * n
        inits = {init.seq_id: init for init in plan.inits}
        assert len(set(seq_ids)) == n <= lim.max_num_seqs and sum(num_tokens) <= lim.max_num_batched_tokens
        assert len(num_tokens) == len(start_pos) == len(num_new_blocks) == len(sample) == len(budgets) == n
        assert len(token_ids) == len(slot_mapping) == sum(num_tokens) and len(new_block_ids) == sum(num_new_blocks)
        assert set(inits) <= set(seq_ids)
        if plan.num_steps > 1:
            assert set(num_tokens) == {1} and all(sample) and not inits, "a multi-step plan only decodes"
            assert all(1 <= b <= plan.num_steps for b in budgets)
        rows, t, b = [], 0, 0
        for i, seq_id in enumerate(seq_ids):
            if seq_id in inits:  # seen for the first time, or again from scratch
                init = inits[seq_id]
                s = init.sampling
                penalized = (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) != (1.0, 0.0, 0.0)
                self.mirrors[seq_id] = Mirror(init.num_prompt_tokens, s.min_tokens, frozenset(s.stop_token_ids),
                                              penalized)
            assert seq_id in self.mirrors, f"seq {seq_id} is unknown to the data plane and has no init"
            mirror = self.mirrors[seq_id]
            mirror.block_table += new_block_ids[b:b + num_new_blocks[i]]
            assert all(0 <= block < lim.num_blocks for block in mirror.block_table)
            tokens, slots = token_ids[t:t + num_tokens[i]], slot_mapping[t:t + num_tokens[i]]
            b, t = b + num_new_blocks[i], t + num_tokens[i]
            if PENDING in tokens:  # the token this sequence sampled in the previous plan
                assert tokens == [PENDING] and mirror.sampled_at == self.plan_index - 1, f"bad pending in {seq_id}"
                tokens = [mirror.last_token]
            end = start_pos[i] + num_tokens[i]
            final = end + budgets[i] - 1  # the context once every step of the plan has run
            assert final <= lim.max_model_len and -(-final // lim.block_size) <= len(mirror.block_table)
            assert slots == [self.slot(mirror, pos) for pos in range(start_pos[i], end)], "slot_mapping is wrong"
            assert not sample[i] or end >= mirror.num_prompt_tokens, "sampled before the prompt is complete"
            rows.append(Row(seq_id, mirror, start_pos[i], tokens, slots, bool(sample[i]), budgets[i]))
        return rows

    def context(self, mirror: Mirror, context_len: int) -> list[int]:
        """Reads positions 0 .. context_len - 1 back through the block table."""
        context = []
        for pos in range(context_len):
            entry = self.kv[self.slot(mirror, pos)]
            assert entry is not None and entry[1] == pos, f"the KV slot of position {pos} holds {entry}"
            context.append(entry[0])
        return context

    def _sample(self, mirror: Mirror, context_len: int) -> int:
        """The model's next token after the first context_len positions."""
        return next_token(self.context(mirror, context_len), mirror.banned(context_len))


# ---- the real data plane's plan handling, checked against the stand-in ----------------------

FED_PAST_BUDGET = VOCAB  # what a sequence samples past its decode budget: never an input (not a token)


def cumsum0(values: list[int]) -> list[int]:
    return [0, *accumulate(values)]


@dataclass
class LaunchedStep:
    """A plan both data planes ran. Reading the result records the real one's samples in its token
    history, as ModelRunner's LaunchedStep.result does: when the result is sent, or earlier when the
    next plan's wait_for_tokens needs them."""

    result_pb: dp.StepResult
    record: Callable[[], None] | None = None

    def result(self) -> dp.StepResult:
        record, self.record = self.record, None
        if record is not None:
            record()
        return self.result_pb


class RealPlanHandling:
    """The data plane's own plan handling on the CPU, with no model: convert.plan_from_pb and InputBatch,
    fed the stand-in's samples where ModelRunner feeds the sampler's. It must accept every plan, and
    what it builds must equal what the stand-in derived."""

    def __init__(self, limits: Limits):
        self.batch = InputBatch(PlanLimits(
            vocab_size=VOCAB, num_kv_blocks=limits.num_blocks, block_size=limits.block_size,
            max_model_len=limits.max_model_len, max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens, max_logprobs=0),  # none asked for
            torch.device("cpu"))
        self.batch.wait_for_tokens = self._wait_for_last_step
        self.last: LaunchedStep | None = None  # ModelRunner._last

    def _wait_for_last_step(self) -> None:
        if self.last is not None:
            self.last.result()

    def reset(self) -> None:
        """A new control-plane stream: the data plane forgets every sequence (ModelRunner.reset)."""
        self.batch.reset()

    def prepare(self, plan: dp.StepPlan) -> StepInputs | None:
        try:
            return self.batch.prepare(plan_from_pb(plan))
        except ValueError as exc:
            raise AssertionError(f"the data plane refuses step {plan.step_id}: {exc}") from exc

    def launched(self, inputs: StepInputs | None, outputs: list[list[int]], result: dp.StepResult) -> LaunchedStep:
        """What ModelRunner.launch leaves: the samples kept on the device for the next plan's PENDING
        tokens (set_last_tokens) and, for a plan of one step, their record once the result is read."""
        step = LaunchedStep(result)
        if inputs is not None and inputs.decode_steps is not None:  # [K, n]: step k's token of row i
            steps = inputs.decode_steps
            tokens = np.full((steps.num_steps, len(outputs)), FED_PAST_BUDGET, dtype=np.int32)
            for i, out in enumerate(outputs):
                tokens[:len(out), i] = out
            self.batch.set_last_tokens(inputs.sample_rows, torch.from_numpy(tokens.ravel())[steps.last.long()])
        elif inputs is not None and inputs.sampling is not None:
            sampled = np.asarray([out[0] for out in outputs if out], dtype=np.int32)
            self.batch.set_last_tokens(inputs.sample_rows, torch.from_numpy(sampled))
            if inputs.sampled is not None:  # None: every row sampled plainly, none keeps a history
                step.record = partial(self.batch.record_sampled, inputs.sampled, sampled)
        self.last = step
        return step

    def check(self, inputs: StepInputs | None, rows: list[Row], num_steps: int, standin: StandInDataPlane) -> None:
        """What InputBatch built for a plan, against the rows the stand-in ran."""
        assert set(self.batch.mirrors) == set(standin.mirrors), "the data planes hold different sequences"
        if not rows:
            assert inputs is None
            return
        query_lens = [len(row.tokens) for row in rows]
        ends = [row.start + len(row.tokens) for row in rows]
        m = inputs.metadata
        assert inputs.input_ids.tolist() == [t for row in rows for t in row.tokens], "input_ids (PENDING resolved)"
        assert inputs.positions.tolist() == [pos for row, end in zip(rows, ends) for pos in range(row.start, end)]
        assert m.slot_mapping.tolist() == [slot for row in rows for slot in row.slots], "slot_mapping"
        assert m.context_lens.tolist() == m.context_lens_host == ends, "context lengths"
        assert m.query_lens_host == query_lens and (m.max_seqlen_q, m.max_seqlen_k) == (max(query_lens), max(ends))
        assert m.cu_seqlens_q.tolist() == cumsum0(query_lens) and m.cu_seqlens_k.tolist() == cumsum0(ends)
        if max(query_lens) == 1:  # a decode step: longest context first, ties in plan order
            assert m.decode_order.tolist() == sorted(range(len(rows)), key=lambda i: -ends[i])
        else:
            assert m.decode_order is None
        self._check_block_tables(m.block_tables, rows)
        self._check_sampling(inputs, rows, standin)
        if num_steps > 1:
            self._check_decode_steps(inputs.decode_steps, rows, standin)
        else:
            assert inputs.decode_steps is None

    def _check_block_tables(self, tables: torch.Tensor, rows: list[Row]) -> None:
        """Each sequence's mirrored block table, and the part of it the plan's attention reads."""
        batch, bs = self.batch, self.batch.limits.block_size
        for i, row in enumerate(rows):
            r = batch.mirrors[row.seq_id]
            assert batch.block_table[r, :batch.num_blocks[r]].tolist() == row.mirror.block_table, f"seq {row.seq_id}"
            read = -(-(row.start + len(row.tokens) + row.budget - 1) // bs)  # once every step of the plan ran
            assert tables[i, :read].tolist() == row.mirror.block_table[:read], f"block table row of seq {row.seq_id}"

    def _check_sampling(self, inputs: StepInputs, rows: list[Row], standin: StandInDataPlane) -> None:
        """Which rows sample, from which hidden state, with which tokens masked and, with penalties,
        which history (the first step's, in a plan of several)."""
        token_ends = cumsum0([len(row.tokens) for row in rows])[1:]
        sampled = [(row, end) for row, end in zip(rows, token_ends) if row.sample]
        ends = [row.start + len(row.tokens) for row, _ in sampled]
        assert inputs.sample_indices.tolist() == [end - 1 for _, end in sampled], "rows of the hidden states"
        batch_rows = [self.batch.mirrors[row.seq_id] for row, _ in sampled]
        assert inputs.sample_rows.tolist() == batch_rows
        if inputs.sampled is None:  # nothing to record: no sampled row keeps a history
            assert sampled and self.batch.plain[batch_rows].all(), "rows to record left out"
        else:
            assert inputs.sampled.rows.tolist() == batch_rows
            assert inputs.sampled.seq_ids.tolist() == [row.seq_id for row, _ in sampled]
            assert inputs.sampled.positions.tolist() == ends, "positions of the sampled tokens"
        sampling = inputs.sampling
        if not sampled:
            assert sampling is None
            return
        banned = set() if sampling.banned is None else set(zip(*(t.tolist() for t in sampling.banned)))
        assert banned == {(j, t) for j, ((row, _), end) in enumerate(zip(sampled, ends))
                          for t in row.mirror.banned(end)}, "tokens masked for min_tokens"
        penalized = [(j, row.mirror, end) for j, ((row, _), end) in enumerate(zip(sampled, ends))
                     if row.mirror.penalized]
        assert (sampling.penalties is not None) == bool(penalized)
        for j, mirror, end in penalized:
            history = np.asarray(standin.context(mirror, end), dtype=np.int64)
            prompt, outputs = history[:mirror.num_prompt_tokens], history[mirror.num_prompt_tokens:]
            assert sampling.penalties.prompt_counts[j].tolist() == np.bincount(prompt, minlength=VOCAB).tolist()
            assert sampling.penalties.output_counts[j].tolist() == np.bincount(outputs, minlength=VOCAB).tolist()

    @staticmethod
    def _check_decode_steps(steps: DecodeSteps, rows: list[Row], standin: StandInDataPlane) -> None:
        """The inputs of every step of a plan of several decode steps. On the CPU all of them are host-built
        and readable (on CUDA a decode graph copies them in); the tokens fed from one step into the next
        are the model runner's device work, stood in for by the stand-in's samples (see launched)."""
        budgets, n = [row.budget for row in rows], len(rows)
        assert steps.num_steps == max(budgets) and steps.budget.tolist() == budgets
        # where each row's last token lands in the [K, n] tokens, the next plan's PENDING: checked here, as
        # the scheduler gives a budget under K only to a sequence whose last token that is
        assert steps.last.tolist() == [(budget - 1) * n + i for i, budget in enumerate(budgets)]
        for k in range(steps.num_steps):  # a row past its budget stays at its last position and stores nothing
            positions = [row.start + min(k, row.budget - 1) for row in rows]
            slots = [standin.slot(row.mirror, row.start + k) if k < row.budget else -1 for row in rows]
            assert steps.positions[k].tolist() == positions, f"positions of decode step {k}"
            assert steps.slot_mapping[k].tolist() == slots, f"slot_mapping of decode step {k}"
            contexts = [pos + 1 for pos in positions]
            assert steps.context_lens[k].tolist() == steps.context_lens_host[k] == contexts
            assert steps.cu_seqlens_k[k].tolist() == cumsum0(contexts)


# ---- the engine core and one replica's step loop --------------------------------------------


@dataclass
class Request:
    """A request and its reference output: its true history, token by token."""

    seq: Sequence
    stop_ids: frozenset[int]
    history: list[int]  # prompt + tokens emitted so far
    finish_reason: FinishReason | None = None

    @property
    def outputs(self) -> list[int]:
        return self.history[self.seq.num_prompt_tokens:]

    def emit(self, token: int, position: int, reason: FinishReason | None, max_model_len: int) -> None:
        """Checks an emitted token and the finish rule applied to it against the reference."""
        params = self.seq.params
        assert self.finish_reason is None and position == len(self.history)
        masked = self.stop_ids if len(self.outputs) < params.min_tokens else frozenset()
        assert token == next_token(self.history, masked), f"seq {self.seq.seq_id}: wrong token at {position}"
        self.history.append(token)
        n = len(self.outputs)
        expected = None
        if token in self.stop_ids and n > params.min_tokens:
            expected = FinishReason.STOP_TOKEN
        elif n == params.max_tokens or len(self.history) == max_model_len:
            expected = FinishReason.LENGTH
        assert reason == expected and n <= params.max_tokens
        self.finish_reason = reason


@dataclass(frozen=True)
class Setup:
    """The data plane's limits and the control plane's settings."""

    limits: Limits
    config: SchedulerConfig
    prefix_caching: bool
    max_steps_in_flight: int


@dataclass(frozen=True)
class Add:
    """A new request."""

    prompt: list[int]
    max_tokens: int
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    penalized: bool = False  # a repetition penalty: the data plane keeps its history

    @property
    def params(self) -> RequestParams:
        sampling = SamplingOptions(repetition_penalty=1.5 if self.penalized else 1.0)
        return RequestParams(max_tokens=self.max_tokens, sampling=sampling, min_tokens=self.min_tokens,
                             stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class Abort:
    """A request cancelled (or ended by a stop string) by the frontend."""

    pick: int  # which unfinished request, modulo their number


TICK = "tick"  # the step loop runs to its next wait
LOSE = "lose"  # the data plane is lost with its KV cache


class Engine:
    """The engine core (requests, aborts, recompute) and one replica's step loop, as generator:
    it yields wherever the replica awaits (sending, receiving, idle), where other events come in."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.scheduler = Scheduler(setup.config, self._block_manager())
        self.dataplane = StandInDataPlane(setup.limits)
        self.real = RealPlanHandling(setup.limits)
        self.requests: list[Request] = []
        self.live: dict[int, Request] = {}  # the core's unfinished sequences
        self.lost = False
        self.loop = self._step_loop()

    def _block_manager(self) -> BlockManager:
        lim = self.setup.limits
        return BlockManager(lim.num_blocks, lim.block_size, self.setup.prefix_caching)

    def handle(self, ev: Add | Abort | str) -> None:
        if isinstance(ev, Add):
            params = ev.params
            seq = Sequence(len(self.requests), str(len(self.requests)), ev.prompt, params)
            request = Request(seq, stop_token_ids(params, EOS_IDS), list(ev.prompt))
            self.requests.append(request)
            self.live[seq.seq_id] = request
            self.scheduler.add(seq)
        elif isinstance(ev, Abort):
            if self.live:
                request = self.live.pop(list(self.live)[ev.pick % len(self.live)])
                self.scheduler.finish(request.seq)
                request.finish_reason = FinishReason.ABORTED
        elif ev == LOSE:
            self.lost = True
        else:
            next(self.loop)
            if not self.lost:
                self.check_blocks()

    def drain(self) -> None:
        """Ticks until every request is finished and the loop idles."""
        for _ in range(20_000):
            if next(self.loop) == "idle":
                assert not self.live, f"the loop idles with unfinished requests: {self.scheduler.waiting}"
                return
            if not self.lost:
                self.check_blocks()
        raise AssertionError("requests never finish")

    def _step_loop(self):
        """replica.py's _step_loop: plans ahead, so up to max_steps_in_flight plans are out at once."""
        in_flight: deque = deque()  # (SchedulerOutput, its StepResult), oldest first
        bs = self.setup.limits.block_size
        while True:
            if self.lost:
                self._reconnect()
                in_flight.clear()
                continue
            out = self.scheduler.schedule()
            if out is None and not in_flight:
                yield "idle"
                continue
            if out is not None:
                plan = encode_plan(out, bs, EOS_IDS)
                launched = self._launch(plan)  # the data plane runs plans in the order sent
                self._note(plan)
                yield "sending"
                if self.lost:
                    continue
                in_flight.append((out, launched))
            if in_flight and (out is None or len(in_flight) >= self.setup.max_steps_in_flight):
                yield "receiving"
                if self.lost:
                    continue
                out, launched = in_flight.popleft()
                self._apply(out, launched.result())

    def _launch(self, plan: dp.StepPlan) -> LaunchedStep:
        """Runs a plan on the stand-in, and checks the real data plane's inputs for it against the stand-in."""
        inputs = self.real.prepare(plan)
        rows, outputs = self.dataplane.run(plan)
        self.real.check(inputs, rows, plan.num_steps, self.dataplane)
        sampled = np.asarray([token for out in outputs for token in out], dtype="<i4")
        return self.real.launched(inputs, outputs, dp.StepResult(step_id=plan.step_id,
                                                                 sampled_token_ids=sampled.tobytes()))

    def _apply(self, out, result: dp.StepResult) -> None:
        """replica.py's _apply: new tokens, and the token rules that end requests."""
        max_model_len = self.setup.limits.max_model_len
        for seq, token, _, position in self.scheduler.update(out, decode_result(result).token_ids):
            request = self.live.get(seq.seq_id)
            if request is None:  # aborted meanwhile
                continue
            reason = token_finish_reason(token, position, seq.num_prompt_tokens, seq.params, request.stop_ids,
                                         max_model_len)
            request.emit(token, position, reason, max_model_len)
            if reason is not None:
                self.scheduler.finish(seq)
                del self.live[seq.seq_id]
                event(f"finished by {reason.value}")

    def _reconnect(self) -> None:
        """The data plane came back empty: a new BlockManager, and the core recomputes (engine_core.py)."""
        seqs = self.scheduler.evict_all()
        self.scheduler.block_manager = self._block_manager()
        self.dataplane = StandInDataPlane(self.setup.limits)
        self.real.reset()  # empty as a restarted data plane, and its rows are reused
        for seq in seqs:
            if seq.seq_id in self.live:
                self.scheduler.add(seq)
        self.lost = False
        event("data plane lost")

    def _note(self, plan: dp.StepPlan) -> None:
        """Labels for the test's statistics (pytest --hypothesis-show-statistics)."""
        if plan.num_steps > 1:
            event("plan of several decode steps")
        if 0 in column(plan.sample, "u1"):
            event("chunked prefill")
        if self.scheduler.num_preemptions:
            event("preempted")
        if self.scheduler.num_prefix_cache_hits:
            event("prefix cache hit")

    # ---- invariants -------------------------------------------------------------------------

    def check_blocks(self) -> None:
        """Reference counts, the free list, shared blocks, and the KV contents of computed positions."""
        sched, bm, kv = self.scheduler, self.scheduler.block_manager, self.dataplane.kv
        bs = bm.block_size
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in sched.running:
            assert len(set(seq.block_table)) == len(seq.block_table) >= bm.blocks_for(seq.num_computed_tokens)
            for index, block_id in enumerate(seq.block_table):
                holders.setdefault(block_id, []).append((seq, index))
            for pos in range(seq.num_computed_tokens):
                entry = kv[seq.block_table[pos // bs] * bs + pos % bs]
                assert entry is not None and entry[1] == pos, f"{seq}: position {pos} has {entry} in the KV cache"
                assert seq.token_ids[pos] in (PENDING, entry[0]), f"{seq}: position {pos} has {entry}"
        assert all(not seq.block_table and not seq.num_computed_tokens for seq in sched.waiting)
        for block in bm.blocks:
            assert block.ref_count == len(holders.get(block.block_id, ())), f"block {block.block_id}"
            assert (block.block_id in bm.free_block_ids) == (block.ref_count == 0)
            if block.hash is not None:  # cached: its K/V stay what its tokens say until it is reused
                entries = kv[block.block_id * bs:(block.block_id + 1) * bs]
                assert None not in entries and [e[0] for e in entries] == block.token_ids, f"block {block.block_id}"
                assert len({e[1] // bs for e in entries}) == 1 and [e[1] % bs for e in entries] == list(range(bs))
        for block_id, held in holders.items():
            if len(held) > 1:  # only a full cached block, at the same place in every table
                assert bm.blocks[block_id].hash is not None and len({index for _, index in held}) == 1
                assert all((index + 1) * bs <= seq.num_computed_tokens for seq, index in held)
        mirrors = self.dataplane.mirrors
        for seq in sched.running:
            assert seq.seq_id in mirrors and mirrors[seq.seq_id].block_table == seq.block_table, f"{seq}'s mirror"
        assert set(mirrors) <= {seq.seq_id for seq in sched.running} | set(sched.dropped_seq_ids)
        for request in self.live.values():
            seq, known = request.seq, len(request.history)
            assert seq.token_ids[:known] == request.history and set(seq.token_ids[known:]) <= {PENDING}

    def check_done(self) -> None:
        """Every block free, every request finished with exactly its tokens."""
        bm = self.scheduler.block_manager
        assert not self.scheduler.has_work()
        assert bm.num_free_blocks == bm.num_blocks and all(block.ref_count == 0 for block in bm.blocks)
        for request in self.requests:
            assert request.finish_reason is not None, f"{request.seq} never finished"
            if request.finish_reason is not FinishReason.ABORTED:
                n, params = len(request.outputs), request.seq.params
                assert n == params.max_tokens or (request.outputs[-1] in request.stop_ids and n > params.min_tokens)


# ---- random schedules -----------------------------------------------------------------------

TOKENS = st.integers(0, VOCAB - 1)


@st.composite
def setups(draw) -> Setup:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(8 // block_size, 24 // block_size))
    max_num_seqs = draw(st.integers(1, 6))
    max_num_batched_tokens = draw(st.integers(max_num_seqs, 16))  # a step holds no more sequences than tokens
    limits = Limits(block_size, num_blocks, draw(st.integers(4, 40)), max_num_seqs, max_num_batched_tokens)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=limits.max_model_len,
        max_prefill_tokens_with_decode=draw(st.none() | st.integers(1, 8)),
        decode_steps=draw(st.sampled_from([1, 2, 4, 8])), decode_steps_max_seqs=draw(st.integers(1, 4)))
    return Setup(limits, config, draw(st.booleans()), draw(st.integers(1, 3)))


@st.composite
def adds(draw, stems: list[list[int]], room: int) -> Add:
    """A request whose prompt often starts with one of the stems; prompt + max_tokens fits room."""
    stem = draw(st.sampled_from(stems))
    prompt = (stem[:draw(st.integers(0, len(stem)))] + draw(st.lists(TOKENS, max_size=4)))[:room - 1]
    prompt = prompt or [draw(TOKENS)]
    max_tokens = draw(st.integers(1, min(12, room - len(prompt))))
    return Add(prompt, max_tokens, min(draw(st.sampled_from([0, 0, 0, 1, 3])), max_tokens),
               draw(st.sampled_from([(), (), (STOP_TOKEN,)])), draw(st.sampled_from([False, False, False, True])),
               draw(st.sampled_from([False, False, False, True])))


@st.composite
def scenarios(draw) -> tuple[Setup, list]:
    setup = draw(setups())
    lim = setup.limits
    room = min(lim.num_blocks * lim.block_size, lim.max_model_len)  # what the frontend lets in
    stems = draw(st.lists(st.lists(TOKENS, min_size=4, max_size=12), min_size=1, max_size=3))
    roll = st.integers(0, 99)  # shrinks towards ticks
    events = []
    for _ in range(draw(st.integers(1, 150))):
        r = draw(roll)
        if r < 58:
            events.append(TICK)
        elif r < 88:
            events.append(draw(adds(stems, room)))
        elif r < 98:
            events.append(Abort(draw(st.integers(0, 9))))
        else:
            events.append(LOSE)
    return setup, events


# With three steps in flight, a prefill chunk of the second request (block size 4) is still in flight
# when that request is preempted and admitted again into another block: applying the old step must not
# put the new, partly written block into the prefix cache (nor index past the new block table).
PREEMPTED_WHILE_IN_FLIGHT = (
    Setup(Limits(4, 3, 10, 2, 4), SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=10),
          True, 3),
    [Add([0], 5, 0, (), False), Add([0] * 9, 1, 0, (), False)],
)


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
@example(PREEMPTED_WHILE_IN_FLIGHT)
def test_scheduler_against_a_stand_in_data_plane(scenario):
    setup, events = scenario
    engine = Engine(setup)
    for ev in events:
        engine.handle(ev)
    engine.drain()
    engine.check_done()
