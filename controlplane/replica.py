"""One data plane as the engine core drives it: its connection, Scheduler, BlockManager and step loop.

With data parallelism the core drives several replicas, each with its own KV cache and
scheduler state; the core owns the sequences and routes each new one to a replica
(``router.py``). A replica that loses its data plane hands its sequences back to the core,
which recomputes them on the others (or on this one once it is back).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.dataplane_client import DataPlaneClient, DataPlaneLost
from twinplane.controlplane.finish import stop_token_ids, token_finish_reason
from twinplane.controlplane.liveness import Silence
from twinplane.controlplane.messages import Rejected, Snapshot, StepFailed, StepOutputs, TokenOutput
from twinplane.controlplane.plan_codec import decode_result, encode_plan, masks_message, store_prompt_logprobs
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import Sequence
from twinplane.proto import dataplane_pb2 as dp, step_path_names

if TYPE_CHECKING:
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore

log = logging.getLogger("twinplane.controlplane")
step_log = logging.getLogger("twinplane.controlplane.steps")  # DEBUG: one line per step
# Steps by path: the graphed ones and plans of several decode steps (the rest ran eagerly),
# keyed by the data plane's StepPath.
STEP_PATHS = step_path_names()
# The step counters, named like ServerStats's fields.
STAT_NAMES = ("steps", "idle_us", "execute_us", "launch_us", "computed_tokens",
              *(f"{path}_{counter}" for path in STEP_PATHS.values() for counter in ("steps", "execute_us")),
              "full_decode_steps", "full_decode_execute_us", "full_decode_idle_us")
RECONNECT_DELAY = 0.5  # seconds between attempts to reach a data plane
RECONNECT_TIMEOUT = 2.0  # seconds one attempt waits for the data plane to answer


def scheduler_config(c: ControlPlaneConfig, desc: dp.DescribeResponse) -> SchedulerConfig:
    """The scheduler's limits for a data plane: the control plane's flags within what the data plane takes,
    and no more sequences in a step than its tokens, however the two were set."""
    budget = min(c.max_num_batched_tokens or desc.max_num_batched_tokens, desc.max_num_batched_tokens)
    return SchedulerConfig(
        max_num_seqs=min(c.max_num_seqs or desc.max_num_seqs, desc.max_num_seqs, budget),
        max_num_batched_tokens=budget,
        max_model_len=desc.max_model_len, max_prefill_tokens_with_decode=c.max_prefill_tokens_with_decode,
        decode_steps=max(min(c.decode_steps, desc.max_decode_steps), 1),
        decode_steps_max_seqs=c.decode_steps_max_seqs, by_priority=c.scheduling_policy == "priority",
        masks_follow=desc.masks_follow)


class Replica:
    def __init__(self, index: int, target: str, core: EngineCore):
        self.index = index
        self.target = target
        self.core = core
        self.config = core.config
        self.dataplane = DataPlaneClient(target, self.config.dataplane_token, self.config.dataplane_timeout,
                                         self.config.dataplane_tls)
        self.dataplane.on_lost = self._on_dataplane_lost
        self.describe: dp.DescribeResponse | None = None
        self.claimed: dp.DescribeResponse | None = None  # the data plane it drives or connects to, once checked
        self.scheduler: Scheduler | None = None
        self.connected = False  # a data plane answered and its Step stream is open
        self.wakeup = asyncio.Event()  # new work arrived, or the data plane was lost
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self._deferred: list[TokenOutput] = []  # the last step's tokens, sent while the next step runs
        # The data plane's idle time before a step counts only while it had work coming: not before
        # the first step planned after the replica ran out of work (or connected).
        self._out_of_work = True
        self._first_after_no_work: int | None = None  # step_id
        self.stalled = False  # its data plane has owed the step loop an answer for stall_timeout
        self._awaiting = False  # the step loop waits on the Step stream (a send or a result)
        self._num_waits = 0  # waits on the Step stream so far
        self._waits_seen = 0  # at the last check_wait()
        self._silence = Silence()

    def __repr__(self) -> str:
        return f"data plane {self.index} ({self.target})"

    @property
    def load(self) -> int:
        """Sequences queued or running here (the router's measure of how busy a replica is)."""
        sched = self.scheduler
        return len(sched.waiting) + len(sched.running) if sched is not None else 0

    @property
    def has_room(self) -> bool:
        """Whether a new sequence would find a place among its running ones (fewer queued or running than
        max_num_seqs)."""
        sched = self.scheduler
        return sched is not None and self.load < sched.config.max_num_seqs

    @property
    def capacity(self) -> int:
        """Tokens its KV cache holds."""
        return self.describe.num_kv_blocks * self.describe.block_size

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.wakeup.set()

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.wakeup.set()

    # ---- the step loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Connects to the data plane, then runs steps; ends only by cancellation or an error."""
        await self._connect()
        await self._step_loop()

    async def _step_loop(self) -> None:
        """Plans ahead, so the data plane always has the next step queued: with
        ``max_steps_in_flight`` 2 it sends N+1, hands the tokens of N-1 to the frontend, then
        receives and applies N (sequences whose tokens are still being sampled hold PENDING)."""
        in_flight: deque = deque()  # steps sent whose results are not applied yet, oldest first
        max_in_flight = self.config.max_steps_in_flight
        draining = False  # a step failed: the steps sent after it come back before anything new is planned
        while True:
            if self.dataplane.lost:  # the stream ended while a result it had sent was read: that one's tokens first
                self._send_deferred()
                await self._reconnect("the step stream ended")
                in_flight.clear()  # lost with the stream; the reset recomputes their sequences
                draining = False
                continue
            out = None if draining else self.scheduler.schedule()
            if out is None and not in_flight:
                self._send_deferred()
                self.wakeup.clear()
                self._out_of_work = True
                await self.wakeup.wait()
                continue
            try:
                if out is not None:
                    if self._out_of_work:
                        self._first_after_no_work, self._out_of_work = out.step_id, False
                    plan = encode_plan(out, self.scheduler.block_manager.block_size,
                                       tuple(self.describe.eos_token_ids))
                    await self._on_stream(self.dataplane.send(plan))
                    in_flight.append(out)
                self._send_deferred()  # while the data plane computes
                if in_flight and (out is None or len(in_flight) >= max_in_flight):
                    result = await self._on_stream(self.dataplane.receive())
                    step = in_flight.popleft()
                    if result.error:
                        self._fail_step(step, result.error, after_failure=draining)
                        draining = True
                    else:
                        self._deferred = self._apply(step, result)
                    if in_flight and in_flight[0].masks_follow:  # they depend on the tokens just applied
                        await self._on_stream(self.dataplane.send(masks_message(in_flight[0])))
                    draining = draining and bool(in_flight)
            except DataPlaneLost as exc:
                self._send_deferred()
                await self._reconnect(str(exc))
                in_flight.clear()
                draining = False

    def _apply(self, out, result: dp.StepResult) -> list[TokenOutput]:
        """The critical path between two steps: new tokens and the token stop rules, so requests
        they end are not scheduled again."""
        tokens = decode_result(result)
        if out.step_id == self._first_after_no_work:
            tokens.idle_us = 0  # the data plane waited for requests, not for the control plane
        self._count(out, tokens)
        max_model_len, logprobs, seqs = self.describe.max_model_len, tokens.logprobs, self.core.seqs
        if out.prompt_asks:
            store_prompt_logprobs(out, tokens)
        outputs = []
        for seq, token, index, position in self.scheduler.update(out, tokens.token_ids):
            seq_id = seq.seq_id
            if seq_id not in seqs:  # aborted meanwhile
                continue
            prompt_logprobs, failure = None, None
            first = position == seq.num_prompt_tokens  # its first output token: its scheduling time goes with it
            scheduled_time = seq.scheduled_time if first else None
            if seq.prompt_logprobs is not None and first:  # out with the first token
                prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
                if any(lp is None for lp in prompt_logprobs[1:]):
                    failure = "prompt_logprobs: this data plane does not compute the prompt's log-probabilities"
            if seq.matcher is not None and failure is None:
                seq.matcher.accept(token)
                failure = seq.matcher.failure
            if failure is not None:
                self.core.abort(seq_id)
                self.core.frontend.send(Rejected(seq_id, failure))
                continue
            stop_ids = seq.stop_ids
            if seq.matcher is not None and seq.params.ignore_eos and seq.matcher.whole:
                stop_ids = stop_token_ids(seq.params, self.core.eos_token_ids, whole=True)
            reason = token_finish_reason(token, position, seq.num_prompt_tokens, seq.params, stop_ids, max_model_len)
            if reason is not None:
                self.core.abort(seq_id)
            outputs.append(TokenOutput(seq_id, token, position, logprobs[index] if logprobs else None,
                                       reason and reason.value, seq.num_cached_tokens, prompt_logprobs,
                                       scheduled_time))
        return outputs

    def _count(self, out, tokens) -> None:
        stats = self.stats
        stats["steps"] += 1
        stats["idle_us"] += tokens.idle_us
        stats["execute_us"] += tokens.execute_us
        stats["launch_us"] += tokens.launch_us
        num_tokens = out.num_batched_tokens
        stats["computed_tokens"] += num_tokens
        path = STEP_PATHS.get(tokens.path)
        if path is not None:
            stats[f"{path}_steps"] += 1
            stats[f"{path}_execute_us"] += tokens.execute_us
        full = self.scheduler.config.max_num_seqs
        if num_tokens == full and len(out.decode_seqs) + len(out.other_chunks) == full:  # one token each
            stats["full_decode_steps"] += 1
            stats["full_decode_execute_us"] += tokens.execute_us
            stats["full_decode_idle_us"] += tokens.idle_us
        self.core.dataplane_step.observe((tokens.prepare_us + tokens.execute_us) * 1e-6)
        if step_log.isEnabledFor(logging.DEBUG):
            step_log.debug("%sstep %d: %d sequences, %d tokens, path %s, idle %d us, prepare %d us, execute %d us",
                           self._log_prefix, out.step_id, len(out.decode_seqs) + len(out.other_chunks), num_tokens,
                           path or "eager", tokens.idle_us, tokens.prepare_us, tokens.execute_us)

    @property
    def _log_prefix(self) -> str:
        return f"data plane {self.index}: " if len(self.core.replicas) > 1 else ""

    def _send_deferred(self) -> None:
        outputs, self._deferred = self._deferred, []
        if outputs:
            self.core.frontend.send(StepOutputs(outputs, self.core.snapshot()))
        elif self.scheduler is not None and not self.scheduler.has_work():
            self.core.frontend.send(Snapshot(self.core.snapshot()))  # falling idle: the frontend sees every block free

    def _fail_step(self, out, error: str, after_failure: bool) -> None:
        """A step the data plane could not run fails only the requests in it. A step sent before an
        earlier one's failure was known may have failed with it (it continues a sequence the data
        plane undid): its sequences start over instead, once the steps in flight are back."""
        live = [seq for seq in out.seqs if seq.seq_id in self.core.seqs]
        if after_failure:
            log.warning("%sstep %d, sent before the failure of the one before it, failed too (%s); "
                        "recomputing its %d sequences", self._log_prefix, out.step_id, error, len(live))
            self.scheduler.recompute(live)
            return
        log.error("%sstep %d failed on the data plane: %s", self._log_prefix, out.step_id, error)
        failed = [seq.seq_id for seq in live]
        for seq_id in failed:
            self.core.abort(seq_id)
        self.core.frontend.send(StepFailed(failed, error))

    # ---- liveness -----------------------------------------------------------------------

    async def _on_stream(self, awaitable):
        """Awaits a send or receive on the Step stream, watched by check_wait()."""
        self._awaiting = True
        self._num_waits += 1
        try:
            result = await awaitable
        finally:
            self._awaiting = False
        if self.stalled:
            log.warning("%s answers again", self)
            self._set_stalled(False)
        return result

    def check_wait(self, elapsed: float) -> None:
        """A tick of the core's watch: a data plane that owes the step loop an answer (a result, or
        room for a plan) for stall_timeout has stalled; after dataplane_timeout it is given up."""
        heard = not self._awaiting or self._num_waits != self._waits_seen  # not waiting, or a new wait
        self._waits_seen = self._num_waits
        waited = self._silence.tick(heard, elapsed)
        if waited >= self.config.dataplane_timeout:
            self.dataplane.abandon(f"no answer on the step stream for {waited:.1f} s")
        elif waited >= self.config.stall_timeout and not self.stalled:
            log.warning("%s has not answered for %.1f s; it counts as stalled", self, waited)
            self._set_stalled(True)

    def _set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        self.core.stalls_changed()

    # ---- connection ---------------------------------------------------------------------

    def _on_dataplane_lost(self) -> None:
        """The Step stream ended on its own: the frontend hears of it now, and the loop wakes to reconnect."""
        self._set_connected(False)
        self.wakeup.set()

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            self.connected = connected
            self.core.connections_changed(connected)

    async def _reconnect(self, why: str) -> None:
        log.warning("%s lost (%s); waiting for it to come back", self, why)
        self.stalled = False
        self._set_connected(False)
        self._out_of_work = True  # a new data plane: its first step's idle is its start-up
        self.core.recompute(self, self.scheduler.evict_all())
        await self._connect()

    async def _connect(self) -> None:
        """Connects to the data plane, retrying until it answers; then sizes a new BlockManager.
        Each new reason it cannot is logged once: at INFO while nothing listens at its address
        (a data plane still loading), else as a warning (a TLS mismatch) or an error (refused)."""
        said = None
        while True:
            try:
                self.claimed = None
                desc = await self.dataplane.connect(timeout=RECONNECT_TIMEOUT, refusal=self._refusal)
                break
            except DataPlaneLost as exc:
                if exc.declined:
                    self._declined()
                if str(exc) != said:
                    if exc.declined:
                        log.error("%s is not taken: %s", self, exc)
                    elif exc.fatal:
                        log.error("%s refused the control plane: %s", self, exc)
                    elif exc.not_up:  # expected while it loads its model
                        log.info("%s is not up yet, retrying every %.1f s: %s", self, RECONNECT_DELAY, exc)
                    else:
                        log.warning("%s cannot be reached, retrying every %.1f s: %s", self, RECONNECT_DELAY, exc)
                said = str(exc)
                await asyncio.sleep(RECONNECT_DELAY)
        self.describe = desc
        c = self.config
        sched_config = scheduler_config(c, desc)
        block_manager = BlockManager(desc.num_kv_blocks, desc.block_size, c.enable_prefix_caching)
        if self.scheduler is None:
            self.scheduler = Scheduler(sched_config, block_manager)
        else:  # a new data plane with an empty KV cache; this replica's sequences went back to the core
            self.scheduler.config, self.scheduler.block_manager = sched_config, block_manager
        self._set_connected(True)
        self.wakeup.set()

    def _refusal(self, desc: dp.DescribeResponse) -> str | None:
        """connect()'s check of the data plane it reached: why the core will not have this replica drive it,
        else None, and it is this replica's from now on (claimed: the replicas that connect after it are
        checked against it even before its stream is open)."""
        why = self.core.refusal(self, desc)
        if why is None:
            self.claimed = desc
        return why

    def _declined(self) -> None:
        """Its data plane was not taken: what it was before no longer stands, so requests that waited for it
        alone are refused."""
        if self.describe is not None:
            self.describe = None
            self.core.connections_changed(False)

    async def close(self) -> None:
        await self.dataplane.close()
