"""Continuous batching with chunked prefill and preemption by recompute.

Every step first gives each running sequence in decode its next token, then
spends what is left of the token budget on prefill chunks: running sequences
still in prefill first, then newly admitted ones (first come, first served, or
by priority: ``by_priority``). So a long prompt never stalls running streams, and
steps mix prefill and decode freely. When KV blocks run out, the newest running
sequence (by priority: the one of the highest priority value) is preempted: its
blocks are freed and it is recomputed later.

A step may be planned while the previous one is still in flight: scheduling advances
each sequence at once, and a sequence whose token is still being sampled decodes that
PENDING token (the data plane feeds its own sampled token back). ``update`` fills the
token in when the result arrives, and only then do full blocks join the prefix cache.

A sequence with structured output does so too, but its next token's mask depends on the one in
flight: such a plan's masks follow it (``plan_codec.masks_message``), once that token is back. A
data plane that does not take masks after their plan (``masks_follow`` off) gets such a sequence
only once its token is back, so it decodes every other step while plans run ahead.

When a few sequences only decode and nothing waits, one plan holds several decode steps
(``decode_steps``): each sequence samples up to that many tokens before the control plane
hears back, so a small batch pays the round trip once per several tokens.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.finish import length_reached, tokens_left
from twinplane.controlplane.sequence import PENDING, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 8192  # tokens in one step
    max_model_len: int = 4096
    # Most prefill tokens in a step that also decodes (None: only max_num_batched_tokens
    # bounds them). Lower values keep inter-token latency steady while long prompts arrive. The cap
    # is lifted while requests queue (the step before left one waiting that could be admitted), so a
    # burst is prefilled at the whole budget.
    max_prefill_tokens_with_decode: int | None = None
    # Decode steps one plan may hold when only a few sequences decode and none waits (1: one
    # step per plan), and the most sequences such a plan takes.
    decode_steps: int = 1
    decode_steps_max_seqs: int = 4
    # Scheduling by priority (RequestParams.priority, then arrival) instead of first come first
    # served: the waiting queue is kept in that order, and the sequence preempted for blocks is the
    # running one that comes last in it.
    by_priority: bool = False
    # The data plane takes plans whose token masks follow them (DescribeResponse.masks_follow): a
    # sequence with structured output is planned while its token is in flight, as others are.
    masks_follow: bool = True

    def __post_init__(self) -> None:
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens)


def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Every running sequence decodes in each step: a budget below max_num_seqs would leave the newest
    ones holding their blocks without a token, and the waiting ones never admitted."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                         f"({max_num_seqs}): every running sequence decodes in each step")


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: tokens [start_pos, start_pos + num_tokens)."""

    seq: Sequence
    start_pos: int
    num_tokens: int
    new_block_ids: list[int]  # block-table entries the data plane has not seen yet
    sample: bool  # the chunk reaches the end of the sequence, so a token is sampled
    is_new_mirror: bool  # the data plane sees this sequence for the first time
    # the sequence's preemptions when planned: once preempted, its result says nothing of the blocks
    # the sequence holds now (it may be running again, from another block table, while the step is in flight)
    num_preemptions: int = 0


@dataclass
class SchedulerOutput:
    """One step. Plain decodes (one token, no new block) are kept as bare sequences, the hot
    path of a large batch; every other share is a ScheduledChunk. Plan order: decodes, then chunks."""

    step_id: int
    decode_seqs: list[Sequence]  # each computes its last token and samples
    decode_start: list[int]  # their positions (= num_computed_tokens when scheduled)
    other_chunks: list[ScheduledChunk]
    dropped_seq_ids: list[int] = field(default_factory=list)
    num_steps: int = 1  # > 1: that many decode steps, each decode and chunk one token with a budget
    decode_budget: list[int] = field(default_factory=list)  # then: tokens each samples, in plan order
    # the plan indexes of the masked sequences whose token masks follow the plan, as they wait for the step
    # before it (set by plan_codec.encode_plan; empty: the plan carries its masks, if any)
    masks_due: list[int] = field(default_factory=list)
    # (sequence, position of the first prompt token scored) of each prompt log-probabilities ask, in the
    # plan's order (set by plan_codec.encode_plan)
    prompt_asks: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def masks_follow(self) -> bool:
        return bool(self.masks_due)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every share of the step as a ScheduledChunk, in plan order."""
        decodes = [ScheduledChunk(seq, start, 1, [], True, False)
                   for seq, start in zip(self.decode_seqs, self.decode_start)]
        return decodes + self.other_chunks

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode_seqs + [c.seq for c in self.other_chunks]

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step computes (all its decode steps)."""
        if self.num_steps > 1:
            return sum(self.decode_budget)
        return len(self.decode_seqs) + sum(c.num_tokens for c in self.other_chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.dropped_seq_ids: list[int] = []  # to tell the data plane in the next plan
        self.step_id = 0
        self.num_preemptions = 0  # since start, for stats
        self.num_prefix_cache_queries = 0  # tokens looked up in the prefix cache at admission, since start
        self.num_prefix_cache_hits = 0  # of those, tokens found there
        self._preempted_now: set[int] = set()  # preempted during the current schedule()
        self._queued = False  # the last schedule() left a sequence waiting: no prefill cap

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING, f"cannot add {seq}"
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Into the waiting queue: in priority order, else at the back (a preempted sequence at the front)."""
        if self.config.by_priority:
            at = bisect.bisect(self.waiting, seq.priority_key, key=lambda s: s.priority_key)
            self.waiting.insert(at, seq)
        elif preempted:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence (finished or aborted) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.drop_pending()  # a step in flight may still compute it; its result is ignored
        seq.status = SequenceStatus.FINISHED

    def recompute(self, seqs: list[Sequence]) -> None:
        """The steps that computed these sequences will not report back: each running one starts
        over from its tokens so far (its KV recomputed, prefix cache permitting), ahead of the queue.
        One preempted since (waiting) drops the tokens those steps owed it too, else the queue would
        wait for them forever."""
        for seq in reversed(seqs):
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)
            if seq.status is not SequenceStatus.FINISHED:
                seq.drop_pending()

    def schedule(self) -> SchedulerOutput | None:
        """Builds the next step, or returns None when nothing can run."""
        self._preempted_now = set()
        output = self._schedule_decode_steps()
        if output is None:
            output = self._schedule_step()
        self._queued = bool(self.waiting)
        return output

    def _schedule_step(self) -> SchedulerOutput | None:
        """One step: decodes, then prefill chunks and admissions within the token budget."""
        budget = self.config.max_num_batched_tokens
        decodes, chunks, prefilling, budget = self._schedule_decodes(budget)
        cap = self.config.max_prefill_tokens_with_decode
        if cap is not None and (decodes or chunks) and not self._admits_queue():
            budget = min(budget, cap)
        budget = self._schedule_prefills(prefilling, chunks, budget)
        self._admit(chunks, budget)
        if self._preempted_now:  # a sequence preempted after it was scheduled must not run
            decodes = [s for s in decodes if s.status is SequenceStatus.RUNNING]
            chunks = [c for c in chunks if c.seq.status is SequenceStatus.RUNNING]
        if not decodes and not chunks:
            return None
        return self._emit(decodes, chunks)

    def _admits_queue(self) -> bool:
        """Whether the last schedule left a sequence waiting that could be admitted now (a place among the
        running ones, a free block): then the prefill cap is lifted, so a burst is prefilled at the whole
        budget. One that cannot be admitted (max_num_seqs reached, the cache full) leaves the cap in place."""
        return (self._queued and bool(self.waiting) and len(self.running) < self.config.max_num_seqs
                and self.block_manager.can_allocate(self.waiting[0], [], 1))

    def _schedule_decodes(self, budget: int) -> tuple[list[Sequence], list[ScheduledChunk], list[Sequence], int]:
        """1. Every running sequence with one token to compute gets it: plain decodes, or a chunk
        when it needs a new block. Returns them, the running sequences still in prefill, and the
        token budget left."""
        decodes: list[Sequence] = []
        chunks: list[ScheduledChunk] = []
        prefilling: list[Sequence] = []
        block_size, max_model_len = self.block_manager.block_size, self.config.max_model_len
        for seq in list(self.running):
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_computed_tokens != 1:
                prefilling.append(seq)
            elif length_reached(num_tokens, seq.num_prompt_tokens, seq.params.max_tokens, max_model_len):
                continue  # its last token is in flight; the result ends it
            elif seq.matcher is not None and not seq.matcher.fixed and seq.has_pending and not self.config.masks_follow:
                continue  # structured output: its next mask waits for the token in flight
            elif budget > 0 and seq.status is SequenceStatus.RUNNING:
                if seq.num_computed_tokens < len(seq.block_table) * block_size:
                    decodes.append(seq)  # room left in the last block: no allocation, no new block
                    budget -= 1
                elif self._reserve(seq, 1):
                    chunks.append(self._chunk(seq, 1))
                    budget -= 1
        return decodes, chunks, prefilling, budget

    def _schedule_prefills(self, prefilling: list[Sequence], chunks: list[ScheduledChunk], budget: int) -> int:
        """2. Running sequences still in prefill (prompt chunks, or recompute); returns the budget left."""
        for seq in prefilling:
            if seq.status is SequenceStatus.RUNNING and budget > 0:
                num_tokens = min(seq.num_uncomputed_tokens, budget)
                if self._reserve(seq, num_tokens):
                    chunks.append(self._chunk(seq, num_tokens))
                    budget -= num_tokens
        return budget

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """3. Waiting sequences in queue order (not one preempted in this very step)."""
        block_size = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.seq_id in self._preempted_now:
                break
            if seq.has_pending:  # preempted while a step in flight samples its token: admit it once it is back
                break
            cached = self.block_manager.find_cached_blocks(seq)
            num_tokens = min(seq.num_tokens - len(cached) * block_size, budget)
            if not self.block_manager.can_allocate(seq, cached, num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, cached, num_tokens)
            # the request reports its first admission's hit, not a recompute's (after a preemption or a lost data
            # plane); one that an earlier engine core ran has its count from that core (with its tokens so far)
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
            if self.block_manager.looks_up(seq):  # not one that computes its whole prompt (prompt log-probabilities)
                self.num_prefix_cache_queries += seq.num_tokens
                self.num_prefix_cache_hits += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_tokens))
            budget -= num_tokens

    def _schedule_decode_steps(self) -> SchedulerOutput | None:
        """Several decode steps in one plan, when every running sequence decodes, nothing waits,
        the batch is small (``decode_steps_max_seqs``) and every sequence samples plainly; else None.

        Each sequence gets a budget of up to ``decode_steps`` tokens (fewer when max_tokens or
        max_model_len comes first) and blocks for them; a token rule that ends it earlier (a stop
        token) drops the rest when the result is applied.
        """
        k, running, bm = self.config.decode_steps, self.running, self.block_manager
        if k <= 1 or self.waiting or not running or len(running) > self.config.decode_steps_max_seqs:
            return None
        seqs, budgets, needed = [], [], 0
        for seq in running:
            if len(seq.token_ids) - seq.num_computed_tokens != 1 or not seq.params.plain_sampling:
                return None
            budget = min(k, tokens_left(len(seq.token_ids), seq.num_prompt_tokens, seq.params.max_tokens,
                                        self.config.max_model_len))
            if budget >= 1:  # else its last token is in flight; the result ends it
                seqs.append(seq)
                budgets.append(budget)
                needed += bm.blocks_for(seq.num_computed_tokens + budget) - len(seq.block_table)
        if not budgets or max(budgets) == 1 or needed > bm.num_free_blocks:
            return None  # one step does it, or blocks are short (one step at a time may preempt)
        decodes, chunks = [], []
        for seq, budget in zip(seqs, budgets):
            if bm.blocks_for(seq.num_computed_tokens + budget) <= len(seq.block_table):
                decodes.append((seq, budget))
            else:
                bm.append(seq, budget)
                chunks.append((self._chunk(seq, 1), budget))
        order = [b for _, b in decodes] + [b for _, b in chunks]
        return self._emit([s for s, _ in decodes], [c for c, _ in chunks], order)

    def _emit(self, decodes: list[Sequence], chunks: list[ScheduledChunk],
              decode_budget: list[int] | None = None) -> SchedulerOutput:
        """Numbers the step and advances its sequences as planned: what it computes counts as
        computed, and each token it samples is PENDING until ``update``."""
        self.step_id += 1
        output = SchedulerOutput(self.step_id, decodes, [s.num_computed_tokens for s in decodes], chunks,
                                 self.dropped_seq_ids)
        self.dropped_seq_ids = []
        if decode_budget is not None:
            output.num_steps, output.decode_budget = max(decode_budget), decode_budget
            for seq, budget in zip(output.seqs, decode_budget):
                seq.num_computed_tokens += budget
                seq.token_ids += [PENDING] * budget
            return output
        for seq in decodes:
            seq.num_computed_tokens += 1
            seq.token_ids.append(PENDING)
        for c in chunks:
            c.seq.num_computed_tokens = c.start_pos + c.num_tokens
            if c.sample:
                c.seq.token_ids.append(PENDING)
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[tuple[Sequence, int, int, int]]:
        """Applies a step's result: fills in the sampled tokens; full blocks join the prefix cache.

        Returns (sequence, token, index among the step's sampled sequences, token position)
        for every sampled token of a sequence not finished meanwhile (several per sequence for
        a plan of several decode steps, in order). A sequence preempted while the step ran keeps
        its tokens (they were sampled from a complete context).
        """
        if output.num_steps > 1:
            return self._update_decode_steps(output, sampled_token_ids)
        num_sampled = len(output.decode_seqs) + sum(c.sample for c in output.other_chunks)
        assert num_sampled == len(sampled_token_ids), (
            f"{len(sampled_token_ids)} tokens for {num_sampled} sampled sequences")
        appended = []
        running, finished = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        for index, (seq, start, token) in enumerate(zip(output.decode_seqs, output.decode_start, sampled_token_ids)):
            if seq.status is finished:
                continue
            pos = start + 1
            seq.token_ids[pos] = token
            if seq.status is running:
                self._cache_full_blocks(seq, pos)
            appended.append((seq, token, index, pos))
        index = len(output.decode_seqs)
        for chunk in output.other_chunks:
            seq, end = chunk.seq, chunk.start_pos + chunk.num_tokens
            if seq.status is running and seq.num_preemptions == chunk.num_preemptions:
                self._cache_full_blocks(seq, end)
            if chunk.sample:
                if seq.status is not finished:
                    seq.token_ids[end] = sampled_token_ids[index]
                    appended.append((seq, sampled_token_ids[index], index, end))
                index += 1
        return appended

    def _update_decode_steps(self, output: SchedulerOutput, sampled_token_ids: list[int]) -> list:
        """update() for a plan of several decode steps: each sequence's decode_budget tokens, in plan order."""
        assert sum(output.decode_budget) == len(sampled_token_ids), (
            f"{len(sampled_token_ids)} tokens for decode budgets summing to {sum(output.decode_budget)}")
        starts = output.decode_start + [c.start_pos for c in output.other_chunks]
        appended, offset = [], 0
        for index, (seq, start, budget) in enumerate(zip(output.seqs, starts, output.decode_budget)):
            tokens, offset = sampled_token_ids[offset:offset + budget], offset + budget
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.token_ids[start + 1:start + 1 + budget] = tokens
            if seq.status is SequenceStatus.RUNNING:
                self._cache_full_blocks(seq, start + budget)
            appended += [(seq, token, index, start + 1 + j) for j, token in enumerate(tokens)]
        return appended

    def _cache_full_blocks(self, seq: Sequence, num_known: int) -> None:
        """Blocks below num_known tokens (known, K/V written) join the prefix cache once full."""
        if num_known >= (len(seq.block_hashes) + 1) * self.block_manager.block_size:
            self.block_manager.cache_full_blocks(seq, num_known)

    def evict_all(self) -> list[Sequence]:
        """The data plane lost its KV cache: returns every sequence, ready to be recomputed, running
        ones first (oldest first), and leaves the scheduler empty, every block free (the data plane it
        reconnects to gets a BlockManager of its own)."""
        seqs = self.running + list(self.waiting)
        for seq in seqs:
            seq.status = SequenceStatus.WAITING
            seq.drop_pending()  # the step that was sampling it is lost
            seq.forget_kv()
        self.running, self.waiting, self.dropped_seq_ids = [], deque(), []
        bm = self.block_manager
        self.block_manager = BlockManager(bm.num_blocks, bm.block_size, bm.enable_prefix_caching)
        return seqs

    # ---- helpers ------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Finds blocks for num_tokens more tokens of seq, preempting newer sequences.

        Returns False when seq itself had to be preempted.
        """
        while not self.block_manager.can_append(seq, num_tokens):
            if self.config.by_priority:
                victim = max(self.running, key=lambda s: s.priority_key)
            else:
                victim = self.running[-1]  # the newest admitted
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.append(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._preempted_now.add(seq.seq_id)
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, preempted=True)

    def _release(self, seq: Sequence) -> None:
        if seq.mirrored:
            self.dropped_seq_ids.append(seq.seq_id)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.forget_kv()

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start, table = seq.num_computed_tokens, seq.block_table
        new_blocks = table[seq.num_blocks_mirrored:] if seq.num_blocks_mirrored < len(table) else []
        chunk = ScheduledChunk(seq, start, num_tokens, new_blocks, start + num_tokens == len(seq.token_ids),
                               not seq.mirrored, seq.num_preemptions)
        seq.num_blocks_mirrored = len(table)
        seq.mirrored = True
        return chunk
