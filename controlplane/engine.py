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
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator

from twinplane.controlplane.api import GenerateCall, Limits, Prompt, RequestOutput
from twinplane.controlplane.block_manager import BlockManager
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.dataplane_client import DataPlaneClient, DataPlaneLost
from twinplane.controlplane.errors import InvalidRequest, NotReady, Overloaded, StepFailed
from twinplane.controlplane.plan_codec import decode_result, encode_plan
from twinplane.controlplane.request_state import RequestState
from twinplane.controlplane.scheduler import Scheduler, SchedulerConfig
from twinplane.controlplane.sequence import FinishReason, Sequence
from twinplane.controlplane.tokenizer import TemplateError, Tokenizer
from twinplane.proto import dataplane_pb2 as dp

log = logging.getLogger("twinplane.controlplane")
RECONNECT_DELAY = 0.5


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
        self.wakeup = asyncio.Event()  # new work arrived
        self.accepting = True
        self._seq_ids = itertools.count(1)
        self._loop_task: asyncio.Task | None = None
        self.stats = {"steps": 0, "idle_us": 0, "execute_us": 0}
        self.on_readiness: list = []  # callbacks(bool), e.g. the health service

    def _set_ready(self, ready: bool) -> None:
        (self.ready.set if ready else self.ready.clear)()
        for callback in self.on_readiness:
            callback(ready and self.accepting)

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> None:
        """Connects to the data plane (capacity first), then starts the step loop."""
        self._on_connected(await self.dataplane.connect(timeout))
        self._loop_task = asyncio.create_task(self._run(), name="twinplane-engine")

    def stop_accepting(self) -> None:
        self.accepting = False
        self._set_ready(self.ready.is_set())

    async def drain(self, grace: float) -> None:
        """Lets in-flight requests finish for up to grace seconds, then ends the rest (UNAVAILABLE)."""
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for state in list(self.requests.values()):
            self.scheduler.finish(state.seq)
            self.requests.pop(state.seq.request_id, None)
            state.fail(NotReady("the server shut down before this request finished"))

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
            max_model_len=desc.max_model_len)
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

    async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        """Runs one request; yields its outputs. Closing the iterator aborts the request."""
        await self.wait_ready()
        state = self._add(call)
        try:
            while True:
                item = await state.outputs.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not state.finished:
                self._finish(state, FinishReason.ABORTED)

    async def wait_ready(self) -> None:
        """Returns once a data plane is connected (requests wait for it, up to their deadline)."""
        if not self.accepting:
            raise NotReady("the server is shutting down")
        await self.ready.wait()

    def _add(self, call: GenerateCall) -> RequestState:
        if not self.accepting:
            raise NotReady("the server is shutting down")
        sched, limits = self.scheduler, self.limits
        if len(sched.waiting) >= self.config.max_waiting_requests:
            raise Overloaded(f"too many waiting requests ({len(sched.waiting)}); retry later")
        request_id = call.request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight")
        prompt = self.tokenize(call.prompt)
        if call.truncate_prompt_tokens and len(prompt) > call.truncate_prompt_tokens:
            prompt = prompt[-call.truncate_prompt_tokens:]
        if not prompt:
            raise InvalidRequest("the prompt is empty after tokenization")
        room = limits.max_model_len - len(prompt)
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; at most {limits.max_model_len - 1} fit "
                                 f"(max_model_len {limits.max_model_len}); shorten it or set truncate_prompt_tokens")
        max_tokens = call.params.max_tokens or room
        if max_tokens > room:
            raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"max_model_len ({limits.max_model_len}); set max_tokens <= {room}")
        bm = sched.block_manager
        if bm.blocks_for(len(prompt) + max_tokens) > bm.num_blocks:
            raise InvalidRequest(f"prompt + max_tokens ({len(prompt) + max_tokens} tokens) can never fit in the "
                                 f"KV cache ({bm.num_blocks * bm.block_size} tokens); lower max_tokens")
        params = call.params if call.params.max_tokens else replace(call.params, max_tokens=max_tokens)
        seq = Sequence(next(self._seq_ids), request_id, prompt, params)
        state = RequestState(seq, self.tokenizer, frozenset(self.describe.eos_token_ids), limits.max_model_len)
        self.requests[request_id] = state
        sched.add(seq)
        self.wakeup.set()
        return state

    def _finish(self, state: RequestState, reason: FinishReason) -> None:
        self.scheduler.finish(state.seq)
        self.requests.pop(state.seq.request_id, None)
        state.emit(reason)

    # ---- the step loop ------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            out = self.scheduler.schedule() if self.ready.is_set() else None
            if out is None:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            plan = encode_plan(out, self.scheduler.block_manager.block_size, tuple(self.describe.eos_token_ids))
            try:
                result = await self.dataplane.step(plan)
            except DataPlaneLost as exc:
                log.warning("data plane lost (%s); waiting for it to come back", exc)
                await self._reconnect()
                continue
            if result.error:
                self._fail_step(out, result.error)
                continue
            self._postprocess(out, result)
            await asyncio.sleep(0)  # let handlers run between steps

    def _postprocess(self, out, result: dp.StepResult) -> None:
        tokens = decode_result(result)
        self.stats["steps"] += 1
        self.stats["idle_us"] += tokens.idle_us
        self.stats["execute_us"] += tokens.execute_us
        touched = []
        for seq, token, index in self.scheduler.update(out, tokens.token_ids):
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            logprobs = tokens.logprobs[index] if tokens.logprobs else None
            reason = state.add_token(token, logprobs)
            if reason is not None:
                self._finish(state, reason)
            else:
                touched.append(state)
        for state in touched:
            state.emit()

    def _fail_step(self, out, error: str) -> None:
        """A step the data plane could not run fails only the requests in it."""
        log.error("step %d failed on the data plane: %s", out.step_id, error)
        for chunk in out.chunks:
            state = self.requests.pop(chunk.seq.request_id, None)
            if state is not None:
                self.scheduler.finish(chunk.seq)
                state.fail(StepFailed(f"the data plane failed to run this request: {error}"))

    async def _reconnect(self) -> None:
        self._set_ready(False)
        while True:
            try:
                self._on_connected(await self.dataplane.connect(timeout=RECONNECT_DELAY * 4))
                log.warning("data plane is back; recomputing %d running sequences", len(self.scheduler.waiting))
                return
            except DataPlaneLost:
                await asyncio.sleep(RECONNECT_DELAY)


