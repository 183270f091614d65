"""The control plane's step loop: schedule -> StepPlan -> data plane -> postprocess.

One asyncio task runs the loop; gRPC handlers add requests and read their
outputs from per-request queues. The engine owns every Sequence, so when the
data plane is lost it waits for a new one, resets the BlockManager and
recomputes the running sequences, as after a preemption: no request is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace
from collections.abc import AsyncIterator

from twinplane.controlplane.api import GenerateCall, Limits, Prompt, RequestOutput
from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.dataplane_client import DataPlaneClient, DataPlaneLost
from twinplane.controlplane.errors import InvalidRequest, NotReady, Overloaded, ServiceError, StepFailed
from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.plan_codec import decode_result, encode_plan
from twinplane.controlplane.request_state import RequestState
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import FinishReason, Sequence
from twinplane.controlplane.tokenizer import TemplateError, Tokenizer
from twinplane.proto import dataplane_pb2 as dp

log = logging.getLogger("twinplane.controlplane")
request_log = logging.getLogger("twinplane.controlplane.requests")  # one line per finished request
# The engine's counters, named like ServerStats's fields; steps by path: the graphed ones
# (the rest ran eagerly), keyed by the data plane's StepPath.
GRAPH_PATHS = {dp.STEP_PATH_DECODE_GRAPH: "decode_graph", dp.STEP_PATH_MIXED_GRAPH: "mixed_graph"}
STAT_NAMES = ("steps", "idle_us", "execute_us", "computed_tokens",
              *(f"{graph}_{counter}" for graph in GRAPH_PATHS.values() for counter in ("steps", "execute_us")),
              "full_decode_steps", "full_decode_execute_us", "full_decode_idle_us")
RECONNECT_DELAY = 0.5  # seconds between attempts to reach a data plane
RECONNECT_TIMEOUT = 2.0  # seconds one attempt waits for the data plane to answer


class Engine:
    def __init__(self, config: ControlPlaneConfig):
        self.config = config
        self.dataplane = DataPlaneClient(config.dataplane, config.dataplane_token)
        self.describe: dp.DescribeResponse | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits: Limits | None = None
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, RequestState] = {}
        self.ready = asyncio.Event()  # a data plane is connected
        self.wakeup = asyncio.Event()  # new work arrived, or the data plane was lost
        self.stopping = asyncio.Event()  # set once the engine stops accepting requests
        self.crashed = asyncio.Event()  # the step loop died of an unexpected error (logged)
        self.accepting = True
        self.num_waiting_ready = 0  # requests waiting for a data plane (they count as waiting)
        self.dataplane.on_lost = self._on_dataplane_lost
        self._seq_ids = itertools.count(1)
        self._loop_task: asyncio.Task | None = None
        self.stats = dict.fromkeys(STAT_NAMES, 0)  # ServerStats counters
        self.metrics = EngineMetrics()
        self.on_readiness: list = []  # callbacks(bool), e.g. the health service
        self._deferred: list = []  # the last step's tokens, streamed while the next step runs

    def _set_ready(self, ready: bool) -> None:
        (self.ready.set if ready else self.ready.clear)()
        for callback in self.on_readiness:
            callback(ready and self.accepting)

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the step loop, which first connects to the data plane (capacity first)."""
        self._loop_task = asyncio.create_task(self._run(), name="twinplane-engine")

    def stop_accepting(self) -> None:
        self.accepting = False
        self.stopping.set()
        self._set_ready(self.ready.is_set())

    async def drain(self, grace: float) -> None:
        """Lets in-flight requests finish for up to grace seconds, then ends the rest (UNAVAILABLE)."""
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for state in list(self.requests.values()):
            self._fail(state, NotReady("the server shut down before this request finished"))

    async def stop(self) -> None:
        self.stop_accepting()
        for state in list(self.requests.values()):
            self._finish(state, FinishReason.ABORTED)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.dataplane.close()

    def _on_connected(self, desc: dp.DescribeResponse) -> None:
        first = self.describe is None
        self.describe = desc
        if first:
            folder = self.config.tokenizer or desc.tokenizer_path
            self.tokenizer = Tokenizer(folder) if folder else None
        c = self.config
        self.limits = Limits(vocab_size=desc.vocab_size, max_model_len=desc.max_model_len,
                             max_logprobs=min(c.max_logprobs, desc.max_logprobs),
                             max_stop_strings=c.max_stop_strings, max_stop_string_len=c.max_stop_string_len)
        sched_config = SchedulerConfig(
            max_num_seqs=min(c.max_num_seqs or desc.max_num_seqs, desc.max_num_seqs),
            max_num_batched_tokens=min(c.max_num_batched_tokens or desc.max_num_batched_tokens,
                                       desc.max_num_batched_tokens),
            max_model_len=desc.max_model_len, max_prefill_tokens_with_decode=c.max_prefill_tokens_with_decode)
        block_manager = BlockManager(desc.num_kv_blocks, desc.block_size, c.enable_prefix_caching)
        if self.scheduler is None:
            self.scheduler = Scheduler(sched_config, block_manager)
        else:  # a new data plane: its KV cache is empty, recompute everything
            self.scheduler.config, self.scheduler.block_manager = sched_config, block_manager
            self.scheduler.reset()
        self._set_ready(True)
        self.wakeup.set()

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send token_ids instead of text or chat")
        try:
            if prompt.messages is not None:
                return self.tokenizer.encode_chat(prompt.messages)
            return self.tokenizer.encode(prompt.text)
        except TemplateError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def outputs(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        """Yields a request's outputs until it finishes; leaving early aborts it.

        Outputs that queued up while the caller was still sending the previous one (a slow
        reader, a loaded server) go out merged into one: a stream that falls behind catches up
        with fewer, larger messages, and one that keeps up is never delayed.
        """
        queue = state.outputs
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, Exception) and item.finish_reason is None and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, Exception):
                        yield item
                        item = later
                    else:
                        item.absorb(later)
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.abort(state)

    def abort(self, state: RequestState) -> None:
        """Ends a request the client gave up on (cancelled, deadline passed); frees its blocks now."""
        if not state.finished:
            self._finish(state, FinishReason.ABORTED)

    async def wait_ready(self, queued: bool = False) -> None:
        """Returns once a data plane is connected; calls wait for it, up to their deadline.

        Queued calls (generations) count against max_waiting_requests while they wait, so an
        outage cannot pile up memory; they get RESOURCE_EXHAUSTED when there is no room.
        """
        if queued:
            self._check_room()
        elif not self.accepting:
            raise NotReady("the server is shutting down")
        if self.ready.is_set():
            return
        self.num_waiting_ready += queued
        try:
            await first_of(self.ready, self.stopping)
        finally:
            self.num_waiting_ready -= queued
        if not self.accepting:
            raise NotReady("the server is shutting down")

    def _check_room(self) -> None:
        if not self.accepting:
            raise NotReady("the server is shutting down")
        waiting = self.num_waiting_ready + (len(self.scheduler.waiting) if self.scheduler else 0)
        if waiting >= self.config.max_waiting_requests:
            raise Overloaded(f"too many waiting requests ({waiting}, max_waiting_requests "
                             f"{self.config.max_waiting_requests}); retry later")

    def add(self, call: GenerateCall) -> RequestState:
        """Queues a validated request (call after wait_ready); returns its state."""
        arrival_time = time.monotonic()
        self._check_room()
        sched = self.scheduler
        request_id = call.request_id
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight")
        prompt = self._prompt_tokens(call)
        params = self._resolve_max_tokens(call.params, len(prompt))
        seq = Sequence(next(self._seq_ids), request_id, prompt, params)
        state = RequestState(seq, self.tokenizer, frozenset(self.describe.eos_token_ids), self.limits.max_model_len,
                             self.config.stream_interval, self.metrics, arrival_time)
        self.requests[request_id] = state
        sched.add(seq)
        self.wakeup.set()
        return state

    def _prompt_tokens(self, call: GenerateCall) -> list[int]:
        prompt = self.tokenize(call.prompt)
        if call.truncate_prompt_tokens and len(prompt) > call.truncate_prompt_tokens:
            prompt = prompt[-call.truncate_prompt_tokens:]
        if not prompt:
            raise InvalidRequest("input: the prompt is empty after tokenization; send at least one token")
        limit = self.limits.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequest(f"input: the prompt has {len(prompt)} tokens; at most {limit - 1} fit "
                                 f"(max_model_len {limit}); shorten it or set truncate_prompt_tokens")
        return prompt

    def _resolve_max_tokens(self, params, num_prompt_tokens: int):
        """Checks max_tokens/min_tokens against the room the prompt leaves; fills in the default."""
        limit = self.limits.max_model_len
        room = limit - num_prompt_tokens
        max_tokens = params.max_tokens or room
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                                 f"exceeds max_model_len ({limit}); set max_tokens <= {room}")
        if params.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens}, "
                                 f"what fits after the {num_prompt_tokens}-token prompt)")
        bm = self.scheduler.block_manager
        if bm.blocks_for(num_prompt_tokens + max_tokens) > bm.num_blocks:
            raise InvalidRequest(f"max_tokens: prompt + max_tokens ({num_prompt_tokens + max_tokens} tokens) can "
                                 f"never fit in the KV cache ({bm.num_blocks * bm.block_size} tokens); lower it")
        return params if params.max_tokens else replace(params, max_tokens=max_tokens)

    def _finish(self, state: RequestState, reason: FinishReason) -> None:
        self.scheduler.finish(state.seq)
        self.requests.pop(state.seq.request_id, None)
        state.emit(reason)
        self.metrics.request_finished(reason, time.monotonic() - state.arrival_time)
        request_log.info(state.summary(reason.value))

    def _fail(self, state: RequestState, error: ServiceError) -> None:
        self.scheduler.finish(state.seq)
        self.requests.pop(state.seq.request_id, None)
        state.fail(error)
        request_log.info(state.summary(f"error:{error.code_name}"))

    # ---- the step loop ------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except Exception:
            log.critical("the control plane's engine stopped on an unexpected error", exc_info=True)
            self.crashed.set()
            raise

    async def _step_loop(self) -> None:
        """Plans step N+1 before step N's result is back, so the data plane always has the next
        step queued: send N+1, stream the outputs of N-1, then receive and apply N."""
        await self._connect()
        in_flight = None  # the step the data plane is computing; its result is not applied yet
        while True:
            if self.dataplane.lost:
                await self._reconnect("the step stream ended")
                in_flight = None  # lost with the stream; the reset recomputes its sequences
                continue
            out = self.scheduler.schedule()
            if out is None and in_flight is None:
                if self._deferred:  # stop strings may end requests: look again after
                    self._emit_deferred()
                    continue
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                if out is not None:
                    plan = encode_plan(out, self.scheduler.block_manager.block_size,
                                       tuple(self.describe.eos_token_ids))
                    await self.dataplane.send(plan)
                self._emit_deferred()  # while the data plane computes
                result = await self.dataplane.receive() if in_flight is not None else None
            except DataPlaneLost as exc:
                self._emit_deferred()
                await self._reconnect(str(exc))
                in_flight = None
                continue
            if result is not None:
                if result.error:
                    self._fail_step(in_flight, result.error)
                else:
                    self._deferred = self._apply(in_flight, result)
            in_flight = out

    def _apply(self, out, result: dp.StepResult) -> list[tuple[RequestState, int, FinishReason | None]]:
        """The critical path between two steps: new tokens and the token stop rules.

        Requests a stop token or the length ends are finished here, so they are not
        scheduled again; detokenization, stop strings and streaming wait for _emit_deferred.
        """
        tokens = decode_result(result)
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
        self.metrics.dataplane_step.observe((tokens.prepare_us + tokens.execute_us) * 1e-6)
        recorded = []
        for seq, token, index, position in self.scheduler.update(out, tokens.token_ids):
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            reason = state.record_token(token, position, tokens.logprobs[index] if tokens.logprobs else None)
            if reason is not None:
                self.scheduler.finish(seq)
            recorded.append((state, token, reason))
        return recorded

    def _emit_deferred(self) -> None:
        """Detokenizes, applies stop strings and pushes each request's new output to its stream."""
        recorded, self._deferred = self._deferred, []
        for state, token, reason in recorded:
            if state.finished:  # aborted meanwhile
                continue
            reason = state.add_text(token, reason)
            if reason is not None:
                self._finish(state, reason)
            else:
                state.emit()

    def _fail_step(self, out, error: str) -> None:
        """A step the data plane could not run fails only the requests in it."""
        log.error("step %d failed on the data plane: %s", out.step_id, error)
        for seq in out.seqs:
            state = self.requests.get(seq.request_id)
            if state is not None:
                self._fail(state, StepFailed(f"the data plane failed to run this request: {error}"))

    def _on_dataplane_lost(self) -> None:
        """The Step stream ended on its own: say NOT_SERVING now, and let the loop reconnect."""
        self._set_ready(False)
        self.wakeup.set()

    async def _reconnect(self, why: str) -> None:
        log.warning("data plane lost (%s); waiting for it to come back", why)
        self._set_ready(False)
        await self._connect()
        log.warning("data plane is back; recomputing %d sequences", len(self.scheduler.waiting))

    async def _connect(self) -> None:
        """Connects to a data plane, retrying until one answers; then sizes (or resets) the BlockManager."""
        while True:
            try:
                self._on_connected(await self.dataplane.connect(timeout=RECONNECT_TIMEOUT))
                return
            except DataPlaneLost as exc:
                if exc.fatal:
                    log.error("the data plane refused the control plane: %s", exc)
                await asyncio.sleep(RECONNECT_DELAY)


async def first_of(*events: asyncio.Event) -> None:
    """Waits until any of events is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
