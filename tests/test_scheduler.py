"""Scheduler: token budget, decode first, chunked prefill, preemption, exact blocks."""

import numpy as np
import pytest

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.plan_codec import encode_plan, masks_message
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import PENDING, RequestParams, Sequence, SequenceStatus

PARAMS = RequestParams(max_tokens=100)


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def add(sched: Scheduler, seq_id: int, num_tokens: int, first_token: int = 0) -> Sequence:
    s = Sequence(seq_id, str(seq_id), list(range(first_token, first_token + num_tokens)), PARAMS)
    sched.add(s)
    return s


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    assert out is not None
    sched.update(out, [token] * sum(c.sample for c in out.chunks))
    return out


def summary(out):
    return [(c.seq.seq_id, c.start_pos, c.num_tokens, c.new_block_ids, c.sample) for c in out.chunks]


def test_prefill_then_decode_with_exact_blocks():
    sched = make()
    add(sched, 1, 6)
    assert summary(step(sched)) == [(1, 0, 6, [0, 1], True)]
    assert summary(step(sched)) == [(1, 6, 1, [], True)]
    assert summary(step(sched)) == [(1, 7, 1, [], True)]
    out = step(sched)  # position 8 needs a third block
    assert summary(out) == [(1, 8, 1, [2], True)]


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    sched = make(max_num_batched_tokens=8)
    add(sched, 1, 20)
    assert summary(step(sched)) == [(1, 0, 8, [0, 1], False)]
    assert summary(step(sched)) == [(1, 8, 8, [2, 3], False)]
    assert summary(step(sched)) == [(1, 16, 4, [4], True)]


def test_decode_goes_first_then_prefill_chunks_fill_the_budget():
    sched = make(max_num_batched_tokens=8)
    a = add(sched, 1, 3)
    step(sched)
    add(sched, 2, 12, first_token=50)
    out = step(sched)
    assert summary(out) == [(1, 3, 1, [], True), (2, 0, 7, [1, 2], False)]
    out = step(sched)
    assert summary(out) == [(1, 4, 1, [3], True), (2, 7, 5, [4], True)]
    assert a.num_output_tokens == 3


def test_max_num_seqs_bounds_admission():
    sched = make(max_num_seqs=2)
    for i in range(3):
        add(sched, i, 2)
    out = step(sched)
    assert [c.seq.seq_id for c in out.chunks] == [0, 1]
    assert len(sched.waiting) == 1


def test_preemption_newest_first_and_recompute():
    sched = make(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    a = add(sched, 1, 3)
    b = add(sched, 2, 3, first_token=10)
    out = step(sched)
    assert summary(out) == [(1, 0, 3, [0, 1], True), (2, 0, 3, [2, 3], True)]
    # both now have 4 tokens, 3 computed: decode fits in their second blocks
    step(sched)
    # both have 5 tokens, 4 computed: each needs a third block, none is free -> b is preempted
    out = step(sched)
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert summary(out) == [(1, 4, 1, [3], True)]  # b's blocks were freed tail first
    assert out.dropped_seq_ids == [2]
    assert b.block_table == [] and b.num_computed_tokens == 0
    sched.finish(a)
    out = step(sched)
    # b is recomputed (prompt + its 2 outputs) as a new mirror; its first block is still cached
    assert [(c.seq.seq_id, c.start_pos, c.num_tokens, c.is_new_mirror) for c in out.chunks] == [(2, 2, 3, True)]
    assert b.num_cached_tokens == 0  # only first admissions count as cached prompt tokens
    assert sched.block_manager.num_free_blocks == 4 - 3


def test_preempted_sequence_is_dropped_from_the_data_plane():
    sched = make(num_blocks=2, block_size=2, max_num_batched_tokens=16)
    add(sched, 1, 2)
    b = add(sched, 2, 2, first_token=10)
    step(sched)  # both 3 tokens, 2 computed; both need a new block, none free
    out = sched.schedule()
    assert [c.seq.seq_id for c in out.chunks] == [1]
    assert b.status is SequenceStatus.WAITING
    assert out.dropped_seq_ids == [2]


def test_full_cache_never_crashes_and_everything_is_freed():
    sched = make(num_blocks=6, block_size=2, max_num_seqs=6, max_num_batched_tokens=6)
    seqs = [add(sched, i, 3, first_token=10 * i) for i in range(6)]
    for _ in range(200):
        out = sched.schedule()
        if out is None:
            break
        sched.update(out, [1] * sum(c.sample for c in out.chunks))
        for s in list(sched.running):
            if s.num_output_tokens >= 4:
                sched.finish(s)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens >= 4 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


def test_prefix_cache_hit_skips_cached_tokens():
    sched = make(num_blocks=16, block_size=4)
    a = add(sched, 1, 10)
    step(sched)
    sched.finish(a)
    b = add(sched, 2, 10)
    out = step(sched)
    assert summary(out) == [(2, 8, 2, out.chunks[0].new_block_ids, True)]
    assert out.chunks[0].new_block_ids[:2] == [0, 1]
    assert b.num_cached_tokens == 8


def test_a_sequence_that_wants_its_prompt_logprobs_is_no_prefix_cache_query():
    """Its prompt is computed whole, never looked up in the cache: the queries count only the tokens
    looked up, so hits / queries is the hit rate of the lookups that took place."""
    sched = make(num_blocks=16, block_size=4)
    done = add(sched, 1, 10)
    step(sched)
    sched.finish(done)
    scored = Sequence(2, "2", list(range(10)), RequestParams(max_tokens=100, prompt_logprobs=1))
    sched.add(scored)
    step(sched)
    again = add(sched, 3, 10)
    step(sched)
    assert (scored.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    assert (sched.num_prefix_cache_queries, sched.num_prefix_cache_hits) == (20, 8)


def test_a_sequence_recomputed_after_its_data_plane_was_lost_reports_its_first_cache_hit():
    """The cached prompt tokens a request reports are its first admission's hit (as vLLM reports them): a data
    plane lost before its first token came back (its step in flight with it) makes it start over on a cache
    that hits more, or less, and neither replaces the first count."""
    warm = make(num_blocks=16, block_size=4)
    done = add(warm, 1, 10)
    step(warm)
    warm.finish(done)  # its first two blocks stay in this cache
    hit = add(warm, 2, 10)
    missed = add(warm, 3, 10, first_token=50)
    warm.schedule()  # both admitted; their first tokens are in flight when the data plane goes
    assert (hit.num_cached_tokens, missed.num_cached_tokens) == (8, 0)
    assert warm.evict_all() == [hit, missed]
    assert hit.num_output_tokens == missed.num_output_tokens == 0 and hit.num_preemptions == 0
    other = make(num_blocks=16, block_size=4)  # another data plane, which holds what missed had missed
    done = add(other, 4, 10, first_token=50)
    step(other)
    other.finish(done)
    for seq in (hit, missed):
        other.add(seq)
    out = step(other)
    assert [(c.seq.seq_id, c.start_pos) for c in out.chunks] == [(2, 0), (3, 8)]  # the replay's hits: 0 and 8
    assert (hit.num_cached_tokens, missed.num_cached_tokens) == (8, 0)


def test_finish_frees_blocks_and_records_drop():
    sched = make()
    a = add(sched, 1, 5)
    step(sched)
    sched.finish(a)
    assert sched.block_manager.num_free_blocks == 16
    out = sched.schedule()
    assert out is None
    add(sched, 2, 1)
    assert sched.schedule().dropped_seq_ids == [1]


def test_prefill_share_of_a_decoding_step_can_be_capped():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_with_decode=5)
    sched = Scheduler(config, BlockManager(64, 4))
    add(sched, 1, 3)
    step(sched)  # nothing decodes yet: the prompt goes in whole
    add(sched, 2, 40, first_token=50)
    out = step(sched)
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 5)]
    sched.finish(sched.running[0])
    out = step(sched)  # no decode left in the step: the whole budget again
    assert [(c.seq.seq_id, c.start_pos, c.num_tokens) for c in out.chunks] == [(2, 5, 35)]


def test_the_prefill_cap_is_lifted_while_requests_queue():
    """A step that leaves a request waiting lifts the cap for the next one, so a burst is prefilled at the
    whole budget; once nothing waits, the cap holds again."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_with_decode=5)
    sched = Scheduler(config, BlockManager(64, 4))
    add(sched, 1, 3)
    step(sched)
    add(sched, 2, 20, first_token=50)
    add(sched, 3, 20, first_token=80)
    out = step(sched)  # nothing waited before: capped, and the third is left waiting
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 5)]
    out = step(sched)  # the queue is taken at the whole budget
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 15), (3, 20)]
    add(sched, 4, 20, first_token=110)
    out = step(sched)  # nothing was left waiting: capped again
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 1), (3, 1), (4, 5)]


def test_the_prefill_cap_stays_while_what_waits_cannot_be_admitted():
    """A request left waiting because max_num_seqs sequences run gets nothing from a lifted cap: the running
    prompt keeps its capped share beside the decodes."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_tokens_with_decode=5)
    sched = Scheduler(config, BlockManager(64, 4))
    add(sched, 1, 3)
    step(sched)
    add(sched, 2, 40, first_token=50)
    add(sched, 3, 20, first_token=80)  # no place for it: two run
    for _ in range(3):
        out = step(sched)
        assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (2, 5)]


def test_next_step_is_planned_before_the_result_arrives():
    sched = make()
    a = add(sched, 1, 6)
    first = sched.schedule()
    assert summary(first) == [(1, 0, 6, [0, 1], True)]
    assert a.token_ids[-1] == PENDING and a.num_computed_tokens == 6
    second = sched.schedule()  # decodes the token the first step is still sampling
    assert summary(second) == [(1, 6, 1, [], True)]
    plan = encode_plan(second, 4, (2,))
    assert np.frombuffer(plan.token_ids, "<i4").tolist() == [PENDING]
    assert [(s.seq_id, t, i, p) for s, t, i, p in sched.update(first, [11])] == [(1, 11, 0, 6)]
    assert a.token_ids == [0, 1, 2, 3, 4, 5, 11, PENDING] and len(a.block_hashes) == 1
    third = sched.schedule()  # position 8 needs a new block
    assert summary(third) == [(1, 7, 1, [], True)]
    sched.update(second, [12])
    assert summary(sched.schedule()) == [(1, 8, 1, [2], True)]
    sched.update(third, [13])
    assert a.token_ids[6:9] == [11, 12, 13] and len(a.block_hashes) == 2  # positions 0..7 known and computed


def test_a_sequence_whose_last_token_is_in_flight_is_not_planned_again():
    sched = make()
    s = Sequence(1, "1", [1, 2, 3], RequestParams(max_tokens=2))
    sched.add(s)
    assert sched.schedule() is not None and sched.schedule() is not None
    assert sched.schedule() is None  # the second output ends it by length


def test_preempted_while_in_flight_keeps_its_token_and_evict_all_forgets_pending():
    sched = make(num_blocks=3)
    a, b = add(sched, 1, 4), add(sched, 2, 4, first_token=20)
    first = sched.schedule()
    assert summary(first) == [(1, 0, 4, [0], True), (2, 0, 4, [1], True)]
    second = sched.schedule()  # both need a new block; only one is free: b is preempted
    assert summary(second) == [(1, 4, 1, [2], True)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.token_ids[-1] == PENDING
    sched.update(first, [5, 6])
    assert b.token_ids == [20, 21, 22, 23, 6] and a.token_ids == [0, 1, 2, 3, 5, PENDING]
    assert summary(sched.schedule()) == [(1, 5, 1, [], True)]
    assert a.token_ids[-2:] == [PENDING, PENDING]
    assert sched.evict_all() == [a, b]  # the data plane was lost with two steps in flight: running first
    assert a.token_ids == [0, 1, 2, 3, 5] and a.num_computed_tokens == 0 and a.block_table == []
    assert a.status is b.status is SequenceStatus.WAITING and not sched.has_work()


def test_sequences_of_a_step_that_will_not_report_back_start_over_ahead_of_the_queue():
    """recompute: a step failed with the one before it; its running sequences lose their tokens in flight
    and their blocks (the data plane is told to drop them) and go first when the next step is planned."""
    sched = make(max_num_batched_tokens=8)
    a, b = add(sched, 1, 4), add(sched, 2, 3, first_token=20)
    sched.update(sched.schedule(), [5, 6])
    c = add(sched, 3, 4, first_token=40)
    failed = sched.schedule()
    assert summary(failed) == [(2, 3, 1, [], True), (1, 4, 1, [2], True), (3, 0, 4, [3], True)]
    sched.finish(a)  # the failure before it failed this request
    sched.dropped_seq_ids.clear()
    sched.recompute(failed.seqs)
    assert [s.seq_id for s in sched.waiting] == [2, 3] and not sched.running
    assert b.token_ids == [20, 21, 22, 6] and c.token_ids == [40, 41, 42, 43]
    assert b.block_table == c.block_table == [] and sorted(sched.dropped_seq_ids) == [2, 3]
    assert sched.block_manager.num_free_blocks == 16
    again = sched.schedule()
    assert [(s, start, n, len(blocks)) for s, start, n, blocks, _ in summary(again)] == [(2, 0, 4, 1), (3, 0, 4, 1)]
    assert all(chunk.is_new_mirror for chunk in again.chunks)  # sent to the data plane again from scratch


def test_a_sequence_preempted_while_its_step_fails_drops_its_pending_token():
    """Three steps in flight: the second admits s, the third preempts it (still owed the second's token);
    the first two fail. recompute() must drop s's pending token, else the waiting queue stops at s."""
    sched = make(num_blocks=2, max_num_seqs=4)
    a = add(sched, 1, 3, first_token=10)
    sched.schedule()  # step 1: a's prompt
    s = add(sched, 2, 3, first_token=20)
    second = sched.schedule()  # a decodes, s's prompt: both owed a token
    third = sched.schedule()  # a needs a second block: s, the newest, is preempted
    assert s.status is SequenceStatus.WAITING and s.has_pending
    sched.finish(a)  # step 1 failed: its request is aborted
    sched.recompute([seq for seq in second.seqs if seq.status is not SequenceStatus.FINISHED])  # step 2 failed
    sched.update(third, [7] * sum(c.sample for c in third.chunks))  # a finished: ignored
    assert not s.has_pending and s.token_ids == [20, 21, 22]
    add(sched, 3, 1, first_token=30)
    out = sched.schedule()
    assert out is not None and {seq.seq_id for seq in out.seqs} == {2, 3}


def make_by_priority(**kwargs) -> Scheduler:
    sched = make(**kwargs)
    sched.config = SchedulerConfig(**{**sched.config.__dict__, "by_priority": True})
    return sched


def add_with_priority(sched: Scheduler, seq_id: int, num_tokens: int, priority: int, first_token: int = 0):
    s = Sequence(seq_id, str(seq_id), list(range(first_token, first_token + num_tokens)),
                 RequestParams(max_tokens=100, priority=priority))
    sched.add(s)
    return s


def test_by_priority_the_lowest_value_is_admitted_first_then_the_earliest():
    sched = make_by_priority(max_num_seqs=1)
    for seq_id, priority in [(1, 5), (2, 0), (3, -1), (4, 0)]:
        add_with_priority(sched, seq_id, 2, priority)
    assert [s.seq_id for s in sched.waiting] == [3, 2, 4, 1]
    admitted = []
    while sched.waiting:
        out = step(sched)
        admitted.append(out.chunks[0].seq.seq_id)
        sched.finish(out.chunks[0].seq)
    assert admitted == [3, 2, 4, 1]
    fcfs = make(max_num_seqs=1)  # the default ignores priorities
    for seq_id, priority in [(1, 5), (2, 0), (3, -1)]:
        add_with_priority(fcfs, seq_id, 2, priority)
    assert [s.seq_id for s in fcfs.waiting] == [1, 2, 3]


def test_by_priority_the_highest_value_is_preempted_and_goes_back_in_its_place():
    sched = make_by_priority(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    a = add_with_priority(sched, 1, 3, priority=9)  # arrives first, but the lowest priority
    b = add_with_priority(sched, 2, 3, priority=1, first_token=10)
    assert summary(step(sched)) == [(2, 0, 3, [0, 1], True), (1, 0, 3, [2, 3], True)]
    step(sched)
    out = step(sched)  # each needs a third block, none is free: a goes, whatever the order of arrival
    assert a.status is SequenceStatus.WAITING and b.status is SequenceStatus.RUNNING
    assert summary(out) == [(2, 4, 1, [3], True)] and out.dropped_seq_ids == [1]
    c = add_with_priority(sched, 3, 2, priority=0, first_token=20)
    later = add_with_priority(sched, 4, 2, priority=9, first_token=30)
    assert list(sched.waiting) == [c, a, later]  # the preempted one keeps its place among equals



class FakeMatcher:
    """Stands in for structured output's TokenMatcher: a mask naming the tokens accepted so far."""

    fixed = False  # its mask depends on the tokens sampled

    def __init__(self):
        self.accepted: list[int] = []

    def mask(self) -> bytes:
        return bytes([len(self.accepted)])


def test_allowed_token_ids_go_in_the_plan_even_with_a_token_in_flight():
    """allowed_token_ids: the same mask at every step, known before the token in flight is, so a plan that
    decodes that PENDING token still carries the mask itself (its masks do not follow)."""
    from twinplane.controlplane.structured import FixedTokens

    sched = make()
    add(sched, 1, 3)
    seq = Sequence(2, "2", [5, 6], RequestParams(max_tokens=100, allowed_token_ids=(3, 9)))
    seq.matcher = FixedTokens(seq.params.allowed_token_ids, 12)
    sched.add(seq)
    assert not seq.params.plain_sampling  # never in a plan of several decode steps
    mask = bytes([0b1000, 0b10])  # tokens 3 and 9
    first = sched.schedule()
    second = sched.schedule()  # planned before the first result: it decodes its PENDING token
    for out in (first, second):
        plan = encode_plan(out, 4, (0,))
        index = [s.seq_id for s in out.seqs].index(2)
        assert [(m.index, m.allowed) for m in plan.token_masks] == [(index, mask)]
        assert not plan.masks_follow and not out.masks_due
    assert np.frombuffer(plan.token_ids, "<i4")[index] == PENDING


def test_a_masked_sequence_decodes_its_token_in_flight_and_its_masks_follow_the_plan():
    """A plan carries the mask of each masked sequence it samples, indexed by its place in the plan. Planned
    while its token is still being sampled, a masked sequence decodes that PENDING token as a free one does,
    but its mask depends on that token: the plan says its masks follow, and ``masks_message`` gives them
    from where the matcher stands once the token is in."""
    sched = make()
    add(sched, 1, 3)
    masked = Sequence(2, "2", [5, 6], RequestParams(max_tokens=100, regex="[ab]+"))
    masked.matcher = FakeMatcher()
    sched.add(masked)
    assert not masked.params.plain_sampling  # never in a plan of several decode steps
    first = sched.schedule()
    plan = encode_plan(first, 4, (0,))
    assert [(m.index, m.allowed) for m in plan.token_masks] == [(1, b"\x00")] and not plan.masks_follow
    assert [init.sampling.masked for init in plan.inits] == [False, True]
    second = sched.schedule()  # planned before the first result: both decode their PENDING token
    plan = encode_plan(second, 4, (0,))
    index = [s.seq_id for s in second.seqs].index(2)
    assert sorted(s.seq_id for s in second.seqs) == [1, 2]
    assert plan.masks_follow and second.masks_follow and not plan.token_masks
    sched.update(first, [7, 8])
    masked.matcher.accepted.append(8)  # the engine core's matcher takes the token: the mask it decides
    masks = masks_message(second)
    assert (masks.step_id, masks.masks_only) == (second.step_id, True)
    assert [(m.index, m.allowed) for m in masks.token_masks] == [(index, b"\x01")]
    sched.update(second, [9, 10])
    masked.matcher.accepted.append(10)
    third = sched.schedule()  # nothing in flight: the mask goes with the plan
    plan = encode_plan(third, 4, (0,))
    index = [s.seq_id for s in third.seqs].index(2)
    assert [(m.index, m.allowed) for m in plan.token_masks] == [(index, b"\x02")] and not plan.masks_follow


def test_without_masks_that_follow_a_masked_sequence_waits_for_its_token_in_flight():
    """A data plane that does not take masks after their plan (DescribeResponse.masks_follow off) gets a
    masked sequence only once its token is back: a plan made meanwhile leaves it out and carries its mask
    inline when it comes."""
    sched = make()
    sched.config = SchedulerConfig(**{**sched.config.__dict__, "masks_follow": False})
    add(sched, 1, 3)
    masked = Sequence(2, "2", [5, 6], RequestParams(max_tokens=100, regex="[ab]+"))
    masked.matcher = FakeMatcher()
    sched.add(masked)
    first = sched.schedule()
    encode_plan(first, 4, (0,))
    second = sched.schedule()  # planned before the first result
    assert [s.seq_id for s in second.seqs] == [1] and not encode_plan(second, 4, (0,)).masks_follow
    sched.update(first, [7, 8])
    masked.matcher.accepted.append(8)
    third = sched.schedule()
    plan = encode_plan(third, 4, (0,))
    assert sorted(s.seq_id for s in third.seqs) == [1, 2] and not plan.masks_follow
    index = [s.seq_id for s in third.seqs].index(2)
    assert [(m.index, m.allowed) for m in plan.token_masks] == [(index, b"\x01")]


def test_rows_in_the_same_state_share_one_mask_on_the_wire():
    """Masks equal to an earlier one in the same message go as a reference to it (TokenMask.same_as), and
    the data plane reads them back as that mask; a reference to nothing before it is refused."""
    from twinplane.dataplane.convert import masks_from_pb
    from twinplane.proto import dataplane_pb2 as dp

    class Fixed:
        fixed = True

        def __init__(self, mask: bytes):
            self._mask = mask

        def mask(self) -> bytes:
            return self._mask

    sched = make()
    shared, other = b"\x05", b"\x02"
    for seq_id, mask in ((1, shared), (2, other), (3, bytes(bytearray(shared)))):  # the third: equal, not the same
        seq = Sequence(seq_id, str(seq_id), [5, 6], RequestParams(max_tokens=10, regex="[ab]+"))
        seq.matcher = Fixed(mask)
        sched.add(seq)
    plan = encode_plan(sched.schedule(), 4, (0,))
    wire = [(m.index, m.allowed, m.same_as) for m in plan.token_masks]
    assert wire == [(0, shared, 0), (1, other, 0), (2, b"", 0)]
    assert masks_from_pb(plan) == {0: shared, 1: other, 2: shared}
    bad = dp.StepPlan(step_id=1, token_masks=[dp.TokenMask(index=0, same_as=3), dp.TokenMask(index=3, allowed=b"\x01")])
    with pytest.raises(ValueError, match="the token mask of plan index 0 is empty and refers to index 3"):
        masks_from_pb(bad)


def test_a_sequence_preempted_in_a_step_is_not_admitted_again_in_it():
    """A sequence preempted to make room stays out of the step that preempted it (its blocks would be freed and
    taken again at once: its cache thrown away for nothing), and waits at the queue's front. Seeded random
    workloads with shared prefixes, tight caches and budgets, checked at every step."""
    rng = np.random.default_rng(7)
    preemptions = 0
    for _ in range(40):
        block_size, max_num_seqs = int(rng.integers(1, 4)), int(rng.integers(2, 6))
        sched = make(num_blocks=int(rng.integers(4, 10)), block_size=block_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=int(rng.integers(max_num_seqs, 12)))
        for seq_id in range(int(rng.integers(3, 7))):
            add(sched, seq_id, int(rng.integers(1, 2 * block_size + 2)), first_token=int(rng.integers(0, 2)) * 100)
        for _ in range(60):
            out = sched.schedule()
            if out is None:
                break
            preempted = set(out.dropped_seq_ids)  # preempted in this step (nothing here is aborted)
            preemptions += len(preempted)
            assert not preempted & {c.seq.seq_id for c in out.chunks}
            assert all(seq.status is SequenceStatus.WAITING for seq in sched.waiting if seq.seq_id in preempted)
            sched.update(out, [1] * sum(c.sample for c in out.chunks))
            for seq in [s for s in sched.running if s.num_output_tokens >= 3]:
                sched.finish(seq)
    assert preemptions > 10  # the workloads do preempt



def test_a_step_holds_no_more_sequences_than_tokens():
    """A token budget below max_num_seqs would starve the newest running sequences (they hold blocks and never
    decode) and every waiting one: refused where both are given, and max_num_seqs lowered to the budget where the
    data plane sets one of them."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\): every running"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    from twinplane.controlplane.config import ControlPlaneConfig

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        ControlPlaneConfig(dataplane="unix:///tmp/dp.sock", max_num_seqs=8, max_num_batched_tokens=4)
    assert ControlPlaneConfig(dataplane="unix:///tmp/dp.sock", max_num_batched_tokens=4).max_num_batched_tokens == 4
    from twinplane.controlplane.replica import scheduler_config
    from twinplane.proto import dataplane_pb2 as dp

    desc = dp.DescribeResponse(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=64, max_decode_steps=8)
    lowered = scheduler_config(ControlPlaneConfig(dataplane="unix:///tmp/dp.sock", max_num_batched_tokens=4), desc)
    assert (lowered.max_num_seqs, lowered.max_num_batched_tokens) == (4, 4)
    kept = scheduler_config(ControlPlaneConfig(dataplane="unix:///tmp/dp.sock", max_num_seqs=8), desc)
    assert (kept.max_num_seqs, kept.max_num_batched_tokens) == (8, 8192)
