"""The engine core: the step loop (schedule -> StepPlan -> data plane -> update), in a process of its own.

The core owns every Sequence, the Scheduler and the BlockManager. It gets new
requests and aborts from the frontend (``Engine``, in the gRPC server's process)
and sends back, once per step, the sampled tokens with the finish reasons that
token rules decide (stop token, length). Text, stop strings and streaming are the
frontend's, so however many clients stream, this process only plans steps and
the data plane never waits on the gRPC server's work.

When the data plane is lost the core waits for a new one, resets the BlockManager
and recomputes the running sequences, as after a preemption: no request is lost.
A data plane that stops answering counts as lost after ``dataplane_timeout``; before
that, once ``stall_timeout`` passes, the core tells the frontend it is stalled. The
core sends the frontend a heartbeat every ``HEARTBEAT_INTERVAL`` seconds, busy or idle.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field

from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane import event_loop
from twinplane.controlplane.dataplane_client import DataPlaneClient, DataPlaneLost
from twinplane.controlplane.ipc import Channel, Remote
from twinplane.controlplane.liveness import Silence, ticks
from twinplane.controlplane.metrics import STEP_BUCKETS, Histogram
from twinplane.controlplane.plan_codec import decode_result, encode_plan
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import FinishReason, RequestParams, Sequence
from twinplane.proto import dataplane_pb2 as dp

log = logging.getLogger("twinplane.controlplane")
step_log = logging.getLogger("twinplane.controlplane.steps")  # DEBUG: one line per step
# Steps by path: the graphed ones (the rest ran eagerly), keyed by the data plane's StepPath.
GRAPH_PATHS = {dp.STEP_PATH_DECODE_GRAPH: "decode_graph", dp.STEP_PATH_MIXED_GRAPH: "mixed_graph"}
# The core's step counters, named like ServerStats's fields.
STAT_NAMES = ("steps", "idle_us", "execute_us", "computed_tokens",
              *(f"{graph}_{counter}" for graph in GRAPH_PATHS.values() for counter in ("steps", "execute_us")),
              "full_decode_steps", "full_decode_execute_us", "full_decode_idle_us")
RECONNECT_DELAY = 0.5  # seconds between attempts to reach a data plane
RECONNECT_TIMEOUT = 2.0  # seconds one attempt waits for the data plane to answer

# What the frontend may call on the core, and what the core calls on the frontend.
CORE_CALLS = frozenset({"add", "abort", "shutdown"})
FRONTEND_CALLS = frozenset({"connected", "lost", "stalled", "step", "step_failed", "snapshot", "heartbeat"})

# One sampled token as the frontend gets it: (seq_id, token_id, position in the sequence,
# TokenLogprobs or None, FinishReason value or None, prompt tokens found in the prefix cache).
TokenOutput = tuple


@dataclass
class CoreSnapshot:
    """The core's numbers, sent with every step and whenever it falls idle."""

    stats: dict[str, int]  # STAT_NAMES
    num_added: int = 0  # add() calls so far
    waiting: int = 0
    running: int = 0
    num_preemptions: int = 0
    free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    dataplane_step: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))  # data-plane seconds per step


def token_finish_reason(seq: Sequence, token_id: int, position: int, stop_ids: frozenset[int],
                        max_model_len: int) -> FinishReason | None:
    """Why a request ends at the token it sampled at position, if a token rule says so."""
    params = seq.params
    num_outputs = position + 1 - seq.num_prompt_tokens
    if token_id in stop_ids and num_outputs > params.min_tokens:
        return FinishReason.STOP_TOKEN
    if num_outputs >= params.max_tokens or position + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


class EngineCore:
    def __init__(self, config: ControlPlaneConfig, frontend, counters: CoreSnapshot | None = None):
        """counters: the last snapshot of the core this one replaces, whose counters it carries on."""
        self.config = config
        self.frontend = frontend  # FRONTEND_CALLS, one-way
        self.dataplane = DataPlaneClient(config.dataplane, config.dataplane_token, config.dataplane_timeout)
        self.dataplane.on_lost = self._on_dataplane_lost
        self.describe: dp.DescribeResponse | None = None
        self.scheduler: Scheduler | None = None
        self.seqs: dict[int, tuple[Sequence, frozenset[int]]] = {}  # unfinished sequences and their stop tokens
        self.eos_token_ids: frozenset[int] = frozenset()
        self.wakeup = asyncio.Event()  # new work arrived, or the data plane was lost
        self.stopped = asyncio.Event()
        self.counters = counters or CoreSnapshot(dict.fromkeys(STAT_NAMES, 0))
        self.stats = dict(self.counters.stats)
        self.num_added = 0
        self.dataplane_step = self.counters.dataplane_step
        self._deferred: list[TokenOutput] = []  # the last step's tokens, sent while the next step runs
        # The data plane's idle time before a step counts only while it had work coming: not before
        # the first step planned after the core ran out of work (or connected).
        self._out_of_work = True
        self._first_after_no_work: int | None = None  # step_id
        self._awaiting_dataplane = False  # the step loop waits for the Step stream (a send or a result)
        self._num_waits = 0  # waits on the Step stream so far
        self._stalled = False  # the frontend was told the data plane stalled

    # ---- calls from the frontend -------------------------------------------------------

    def add(self, seq_id: int, request_id: str, prompt: list[int], params: RequestParams,
            output_ids: list[int] = (), num_cached_tokens: int = 0) -> None:
        """A new request; or one a previous core had started (its tokens so far), to recompute."""
        seq = Sequence(seq_id, request_id, prompt, params)
        seq.token_ids += output_ids
        seq.num_cached_tokens = num_cached_tokens
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self.seqs[seq_id] = seq, stop_ids
        self.num_added += 1
        self.scheduler.add(seq)
        self.wakeup.set()

    def abort(self, seq_id: int) -> None:
        """The frontend ended this sequence (cancelled, stop string, failed): free its blocks now."""
        entry = self.seqs.pop(seq_id, None)
        if entry is not None:
            self.scheduler.finish(entry[0])
            self.wakeup.set()

    def shutdown(self) -> None:
        self.stopped.set()
        self.wakeup.set()

    def snapshot(self) -> CoreSnapshot:
        sched = self.scheduler
        if sched is None:
            return CoreSnapshot(dict(self.stats), self.num_added, dataplane_step=self.dataplane_step)
        bm = sched.block_manager
        return CoreSnapshot(dict(self.stats), self.num_added, len(sched.waiting), len(sched.running),
                            sched.num_preemptions, bm.num_free_blocks, bm.num_blocks,
                            sched.num_prefix_cache_queries, sched.num_prefix_cache_hits, self.dataplane_step)

    # ---- the step loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Connects to the data plane, then runs steps until shutdown(); sends heartbeats meanwhile."""
        loop = asyncio.create_task(self._connect_and_step())
        stopped = asyncio.create_task(self.stopped.wait())
        watch = asyncio.create_task(self._watch())
        try:
            done, _ = await asyncio.wait((loop, stopped), return_when=asyncio.FIRST_COMPLETED)
            if loop in done:
                loop.result()  # the loop only ends by an error: raise it
        finally:
            for task in (loop, stopped, watch):
                task.cancel()
            await asyncio.gather(loop, watch, return_exceptions=True)
            await self.dataplane.close()

    async def _watch(self) -> None:
        """Every tick: a heartbeat to the frontend, and the step loop's wait on the data plane checked."""
        silence, seen = Silence(), 0
        async for elapsed in ticks():
            self.frontend.heartbeat()
            heard = not self._awaiting_dataplane or self._num_waits != seen  # not waiting, or a new wait
            seen = self._num_waits
            self._check_wait(silence.tick(heard, elapsed))

    def _check_wait(self, waited: float) -> None:
        """The data plane owes the step loop a result (or room for a plan): flags a stall, then gives up."""
        c = self.config
        if waited >= c.dataplane_timeout:
            self.dataplane.abandon(f"no answer on the step stream for {waited:.1f} s")
        elif waited >= c.stall_timeout and not self._stalled:
            log.warning("the data plane has not answered for %.1f s; reporting NOT_SERVING", waited)
            self._stalled = True
            self.frontend.stalled(True)

    async def _on_stream(self, awaitable):
        """Awaits a send or receive on the Step stream, watched by _watch()."""
        self._awaiting_dataplane = True
        self._num_waits += 1
        try:
            result = await awaitable
        finally:
            self._awaiting_dataplane = False
        if self._stalled:
            log.warning("the data plane answers again")
            self._stalled = False
            self.frontend.stalled(False)
        return result

    async def _connect_and_step(self) -> None:
        await self._connect()
        await self._step_loop()

    async def _step_loop(self) -> None:
        """Plans ahead, so the data plane always has the next step queued: with
        ``max_steps_in_flight`` 2 it sends N+1, hands the tokens of N-1 to the frontend, then
        receives and applies N (sequences whose tokens are still being sampled hold PENDING)."""
        in_flight: deque = deque()  # steps sent whose results are not applied yet, oldest first
        max_in_flight = self.config.max_steps_in_flight
        while True:
            if self.dataplane.lost:
                await self._reconnect("the step stream ended")
                in_flight.clear()  # lost with the stream; the reset recomputes their sequences
                continue
            out = self.scheduler.schedule()
            if out is None and not in_flight:
                self._send_deferred()
                self.wakeup.clear()
                self._out_of_work = True
                await self.wakeup.wait()
                continue
            result = None
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
            except DataPlaneLost as exc:
                self._send_deferred()
                await self._reconnect(str(exc))
                in_flight.clear()
                continue
            if result is not None:
                step = in_flight.popleft()
                if result.error:
                    self._fail_step(step, result.error)
                else:
                    self._deferred = self._apply(step, result)

    def _apply(self, out, result: dp.StepResult) -> list[TokenOutput]:
        """The critical path between two steps: new tokens and the token stop rules, so requests
        they end are not scheduled again."""
        tokens = decode_result(result)
        if out.step_id == self._first_after_no_work:
            tokens.idle_us = 0  # the data plane waited for requests, not for the control plane
        stats = self.stats
        stats["steps"] += 1
        stats["idle_us"] += tokens.idle_us
        stats["execute_us"] += tokens.execute_us
        num_tokens = out.num_batched_tokens
        stats["computed_tokens"] += num_tokens
        graph = GRAPH_PATHS.get(tokens.path)
        if graph is not None:
            stats[f"{graph}_steps"] += 1
            stats[f"{graph}_execute_us"] += tokens.execute_us
        full = self.scheduler.config.max_num_seqs
        if num_tokens == full and len(out.decode_seqs) + len(out.other_chunks) == full:  # one token each
            stats["full_decode_steps"] += 1
            stats["full_decode_execute_us"] += tokens.execute_us
            stats["full_decode_idle_us"] += tokens.idle_us
        self.dataplane_step.observe((tokens.prepare_us + tokens.execute_us) * 1e-6)
        if step_log.isEnabledFor(logging.DEBUG):
            step_log.debug("step %d: %d sequences, %d tokens, path %s, idle %d us, prepare %d us, execute %d us",
                           out.step_id, len(out.decode_seqs) + len(out.other_chunks), num_tokens,
                           graph or "eager", tokens.idle_us, tokens.prepare_us, tokens.execute_us)
        max_model_len, logprobs = self.describe.max_model_len, tokens.logprobs
        outputs = []
        for seq, token, index, position in self.scheduler.update(out, tokens.token_ids):
            seq_id = seq.seq_id
            entry = self.seqs.get(seq_id)
            if entry is None:  # aborted meanwhile
                continue
            reason = token_finish_reason(seq, token, position, entry[1], max_model_len)
            if reason is not None:
                self.scheduler.finish(seq)
                del self.seqs[seq_id]
            outputs.append((seq_id, token, position, logprobs[index] if logprobs else None,
                            reason and reason.value, seq.num_cached_tokens))
        return outputs

    def _send_deferred(self) -> None:
        outputs, self._deferred = self._deferred, []
        if outputs:
            self.frontend.step(outputs, self.snapshot())
        elif self.scheduler is not None and not self.scheduler.has_work():
            self.frontend.snapshot(self.snapshot())  # falling idle: the frontend sees every block free

    def _fail_step(self, out, error: str) -> None:
        """A step the data plane could not run fails only the requests in it."""
        log.error("step %d failed on the data plane: %s", out.step_id, error)
        failed = [seq.seq_id for seq in out.seqs if seq.seq_id in self.seqs]
        for seq_id in failed:
            self.abort(seq_id)
        self.frontend.step_failed(failed, error)

    def _on_dataplane_lost(self) -> None:
        """The Step stream ended on its own: tell the frontend now, and let the loop reconnect."""
        self.frontend.lost()
        self.wakeup.set()

    async def _reconnect(self, why: str) -> None:
        log.warning("data plane lost (%s); waiting for it to come back", why)
        self.frontend.lost()
        self._stalled = False  # lost() ends the stall too
        self._out_of_work = True  # a new data plane: its first step's idle is its start-up
        await self._connect()
        log.warning("data plane is back; recomputing %d sequences", len(self.scheduler.waiting))

    async def _connect(self) -> None:
        """Connects to a data plane, retrying until one answers; then sizes (or resets) the BlockManager."""
        while True:
            try:
                desc = await self.dataplane.connect(timeout=RECONNECT_TIMEOUT)
                break
            except DataPlaneLost as exc:
                if exc.fatal:
                    log.error("the data plane refused the control plane: %s", exc)
                await asyncio.sleep(RECONNECT_DELAY)
        self.describe = desc
        self.eos_token_ids = frozenset(desc.eos_token_ids)
        c = self.config
        sched_config = SchedulerConfig(
            max_num_seqs=min(c.max_num_seqs or desc.max_num_seqs, desc.max_num_seqs),
            max_num_batched_tokens=min(c.max_num_batched_tokens or desc.max_num_batched_tokens,
                                       desc.max_num_batched_tokens),
            max_model_len=desc.max_model_len, max_prefill_tokens_with_decode=c.max_prefill_tokens_with_decode)
        block_manager = BlockManager(desc.num_kv_blocks, desc.block_size, c.enable_prefix_caching)
        if self.scheduler is None:
            self.scheduler = self._new_scheduler(sched_config, block_manager)
        else:  # a new data plane: its KV cache is empty, recompute everything
            self.scheduler.config, self.scheduler.block_manager = sched_config, block_manager
            self.scheduler.reset()
        self.frontend.connected(desc, self.snapshot())
        self.wakeup.set()


    def _new_scheduler(self, config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
        scheduler = Scheduler(config, block_manager)
        counters = self.counters
        scheduler.num_preemptions = counters.num_preemptions
        scheduler.num_prefix_cache_queries = counters.prefix_cache_queries
        scheduler.num_prefix_cache_hits = counters.prefix_cache_hits
        return scheduler


# ---- the core's process ---------------------------------------------------------------------


def start_core_process(config: ControlPlaneConfig) -> tuple[subprocess.Popen, Channel]:
    """Starts the engine core in a child process; returns it and the frontend's end of their channel.

    The child gets its end of a socketpair as an inherited file descriptor; the frontend's first
    call on the channel must be ``configure(config, counters)`` (so no secret shows on a command
    line; counters: the CoreSnapshot of the core this one replaces, or None).
    """
    frontend_end, core_end = socket.socketpair()
    with core_end:
        process = subprocess.Popen(
            [sys.executable, "-c", "from twinplane.controlplane.engine_core import main; main()",
             str(core_end.fileno()), str(logging.getLogger().level)],
            pass_fds=(core_end.fileno(),), stdin=subprocess.DEVNULL)
    return process, Channel(frontend_end)


def main() -> None:
    """The engine core's process: ``main()`` with argv [socket fd, log level]."""
    # Ctrl-C reaches the whole process group; the frontend shuts the core down in order (a
    # shutdown call, or the channel closing when the frontend is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, log_level = int(sys.argv[1]), int(sys.argv[2])
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sock = socket.socket(fileno=fd)
    event_loop.run(_serve_core(sock))


async def _serve_core(sock: socket.socket) -> None:
    """Runs the core until the frontend says shutdown or goes away."""
    channel = Channel(sock)
    await channel.open()
    first = await channel.receive()
    if first is None:
        return  # the frontend went away before it said anything
    name, (config, counters) = first
    assert name == "configure", f"the engine core's first call must be configure, got {name!r}"
    core = EngineCore(config, Remote(channel, FRONTEND_CALLS), counters)
    calls = asyncio.create_task(channel.serve(core, CORE_CALLS))
    calls.add_done_callback(lambda _: core.shutdown())  # the frontend is gone: nobody to serve
    try:
        await core.run()
    except Exception:
        log.critical("the control plane's engine core stopped on an unexpected error", exc_info=True)
        raise
    finally:
        calls.cancel()
        channel.close()
