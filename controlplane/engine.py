"""The control plane's frontend: requests, validation, text and streams; the step loop runs apart.

The gRPC and HTTP handlers add requests here and read their outputs from per-request queues.
The engine core (``engine_core.py``), in a process of its own, owns every Sequence
and runs the step loop; once per step it sends the sampled tokens, which this
side detokenizes, checks against stop strings and streams. So streaming to many
clients costs this process's CPU, never the time between two data-plane steps.

Health says SERVING while the core has a data plane and neither the data plane nor the
core is stalled. A core that dies is replaced (``supervisor.py``); the requests in flight
go to the new core with their tokens so far and are recomputed, as after a preemption.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from collections import Counter
from collections.abc import AsyncIterator, Callable

from twinplane.controlplane.api import GenerateCall, Limits, Prompt, RequestOutput
from twinplane.controlplane.config import BYTES_PER_TOKEN, ControlPlaneConfig
from twinplane.controlplane.errors import (InvalidRequest, NoLongerFits, NotReady, Overloaded, ServiceError,
                                          StepFailed, StreamNotRead)
from twinplane.controlplane import fanout
from twinplane.controlplane.finish import Limit, default_max_tokens, misfit, output_room
from twinplane.controlplane.generation_config import GenerationConfigError, server_defaults
from twinplane.controlplane import messages
from twinplane.controlplane.messages import CoreSnapshot, DataPlaneSnapshot, TokenOutput
from twinplane.controlplane.metrics import DATAPLANE_COUNTERS, EngineMetrics
from twinplane.controlplane.replica import STAT_NAMES
from twinplane.controlplane.request_state import RequestState, Unsent
from twinplane.controlplane.sequence import FinishReason, RequestParams
from twinplane.controlplane.structured import bad_words_ids
from twinplane.controlplane.supervisor import CoreSupervisor
from twinplane.controlplane.tokenizer import Tokenizer, TokenizerFilesError
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import set_fields

log = logging.getLogger("twinplane.controlplane")
request_log = logging.getLogger("twinplane.controlplane.requests")  # one line per finished request
MAX_CORES_PER_REQUEST = 2  # a request in flight when this many engine cores died fails (it may be the cause)


class Engine:
    """One frontend of a control plane. Frontend 0 (the primary) starts, feeds and stops the engine
    core process; the others (index 1..api_server_count-1, ``frontends.py``) feed the same core
    through a CoreLink. The limits of the whole service are split evenly between the frontends."""

    def __init__(self, config: ControlPlaneConfig, index: int = 0, link=CoreSupervisor):
        """link(config, engine): what runs this frontend's side of the engine core."""
        self.config = config
        self.index = index
        self.describe: dp.DescribeResponse | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits: Limits | None = None
        self.requests: dict[int, RequestState] = {}  # in flight, by the core's seq_id
        self.unsent = Unsent()  # outputs queued for streams, finished requests' included, until sent
        self.core_snapshot = CoreSnapshot(dict.fromkeys(STAT_NAMES, 0))  # the latest the core sent
        self.ready = asyncio.Event()  # serving: a data plane is connected and nothing is stalled
        self.stopping = asyncio.Event()  # set once the engine stops accepting requests
        self.crashed = asyncio.Event()  # the engine stopped on an unexpected error (logged)
        self.accepting = True
        self.num_waiting_ready = 0  # requests waiting for a data plane (they count as waiting)
        self.num_tokenizing = 0  # requests being parsed or tokenized (they count as waiting too)
        # tokenizing and chat templates: off the event loop, a few at a time (bounded memory)
        self._tokenizer_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="twinplane-tokenizer")
        self._num_added = 0  # requests sent to the core (core_snapshot.num_added: those it had seen)
        self._seq_ids = fanout.seq_ids(index, config.api_server_count)
        self.metrics = EngineMetrics()
        # each data plane's counters as the engine cores before this one left them, by (target, name)
        self.dataplane_counters_carried: Counter[tuple[str, str]] = Counter()
        self.on_readiness: list = []  # callbacks(bool), e.g. the health service
        self.supervisor = link(config, self)
        self._core_task: asyncio.Task | None = None
        self._connected = False  # the engine core has a data plane
        self._stalls: set[str] = set()  # what stalled ("data plane", "engine core")
        self._replay = False  # the core died: send the requests in flight to the next one when it connects

    def _update_ready(self) -> None:
        ready = self._connected and not self._stalls
        (self.ready.set if ready else self.ready.clear)()
        for callback in self.on_readiness:
            callback(self.serving)

    @property
    def serving(self) -> bool:
        """Whether new requests are taken and go on at once (health checks say SERVING)."""
        return self.ready.is_set() and self.accepting

    def why_not_serving(self) -> str:
        """What a request that cannot wait is told while not ``serving``."""
        if not self.accepting:
            return "the server is shutting down"
        if self._replay:
            return "the engine core is restarting; retry later"
        if not self._connected:
            return ("no data plane is connected yet; retry later" if self.describe is None else
                    "no data plane is connected: it was lost, and the control plane reconnects; retry later")
        return f"the {' and the '.join(sorted(self._stalls))} stalled; retry later"

    def _set_stalled(self, what: str, stalled: bool) -> None:
        (self._stalls.add if stalled else self._stalls.discard)(what)
        self._update_ready()

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the engine core's process, which first connects to the data plane (capacity first)."""
        self._core_task = asyncio.create_task(self._run_core(), name="twinplane-engine-core")

    async def _run_core(self) -> None:
        try:
            await self.supervisor.run()
        except Exception as exc:
            if isinstance(exc, TokenizerFilesError):  # a file to mend, not a fault of this code: no traceback
                log.critical("the control plane's engine stopped: it cannot load the tokenizer: %s", exc)
            elif isinstance(exc, GenerationConfigError):  # the same: a file or flag to mend
                log.critical("the control plane's engine stopped: a generation default is out of range: %s", exc)
            else:
                log.critical("the control plane's engine stopped on an unexpected error", exc_info=True)
            self.crashed.set()
            self._connected = False
            self._update_ready()
            for state in list(self.requests.values()):
                self._fail(state, NotReady("the control plane's engine stopped; retry later"), tell_core=False)

    def stop_accepting(self) -> None:
        self.accepting = False
        self.stopping.set()
        self._update_ready()

    async def drain(self, grace: float) -> int:
        """Lets in-flight requests finish for up to grace seconds, then ends the rest (UNAVAILABLE);
        returns how many it ended."""
        self.stop_accepting()
        await _wait_until(lambda: not self.requests, grace, interval=0.05)
        ended = list(self.requests.values())
        for state in ended:
            self._fail(state, NotReady("the server shut down before this request finished"))
        return len(ended)

    async def streams_closed(self, timeout: float) -> None:
        """Returns once every call has taken its last output (its handler then ends it), or after timeout."""
        await _wait_until(lambda: not self.unsent.streams, timeout, interval=0.02)

    async def stop(self) -> None:
        self.stop_accepting()
        for state in list(self.requests.values()):
            self._finish(state, FinishReason.ABORTED)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        await self.supervisor.stop()
        if self._core_task is not None:
            self._core_task.cancel()
            await asyncio.gather(self._core_task, return_exceptions=True)

    # ---- messages from the engine core --------------------------------------------------

    def receive(self, message: messages.FrontendMessage) -> None:
        """Applies a message from the engine core (the most frequent first)."""
        match message:
            case messages.StepOutputs(outputs, snapshot):
                self.step(outputs, snapshot)
            case messages.Snapshot(snapshot):
                self.snapshot(snapshot)
            case messages.Heartbeat():
                self.heartbeat()
            case messages.Connected(describe, snapshot):
                self.connected(describe, snapshot)
            case messages.Lost():
                self.lost()
            case messages.Stalled(stalled):
                self.stalled(stalled)
            case messages.StepFailed(seq_ids, error):
                self.step_failed(seq_ids, error)
            case messages.Refused(reasons):
                self.refused(reasons)
            case messages.Rejected(seq_id, why):
                self.rejected(seq_id, why)
            case _:
                raise AssertionError(f"unexpected message for a frontend: {message!r}")

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may ask for the model by, the one reported first: the configured ones,
        else the data plane's (once one has connected)."""
        return self.config.served_model_names or (self.describe.model,)

    @property
    def model_name(self) -> str:
        """The name reported first ("" until a data plane has told it, when none is configured)."""
        return self.model_names[0] if self.config.served_model_names or self.describe else ""

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV cache of the smallest connected data plane holds."""
        return self.describe.num_kv_blocks * self.describe.block_size

    def connected(self, desc: dp.DescribeResponse, snapshot: CoreSnapshot) -> None:
        defaults = self._defaults(desc)  # first: one out of range stops the engine (GenerationConfigError)
        if self.describe is None:
            folder = self.config.tokenizer or desc.tokenizer_path
            self.tokenizer = Tokenizer(folder, self.config.chat_template) if folder else None
        self.describe = desc
        c = self.config
        self.limits = Limits(vocab_size=desc.vocab_size, max_model_len=desc.max_model_len,
                             max_logprobs=min(c.max_logprobs, desc.max_logprobs),
                             max_stop_strings=c.max_stop_strings, max_stop_string_len=c.max_stop_string_len,
                             max_prompt_bytes=c.max_prompt_bytes or BYTES_PER_TOKEN * desc.max_model_len,
                             max_chat_messages=c.max_chat_messages, by_priority=c.scheduling_policy == "priority",
                             defaults=defaults)
        self.snapshot(snapshot)
        if self._replay:
            self._replay = False
            log.warning("the new engine core carries on with %d requests in flight", len(self.requests))
            for state in self.requests.values():
                self._send_to_core(state)
        self._connected = True
        self._set_stalled("data plane", False)

    def _defaults(self, desc: dp.DescribeResponse) -> dict[str, float | int]:
        """The defaults of what requests leave unset (generation_config.py), logged by the first frontend when
        they change (at the first connection: when there are any, as vLLM logs them)."""
        c = self.config
        described = set_fields(desc.generation_config)
        defaults = server_defaults(c.generation_config, c.override_generation_config, described)
        if self.index == 0 and defaults != (self.limits.defaults if self.limits else {}):
            log.info("defaults of the fields requests leave unset: %s (--generation-config %s%s)", defaults,
                     c.generation_config, " and --override-generation-config" if c.override_generation_config else "")
        return defaults

    def lost(self) -> None:
        """The data plane is gone: NOT_SERVING until the core connects to a new one."""
        self._connected = False
        self._set_stalled("data plane", False)

    def stalled(self, stalled: bool) -> None:
        """The data plane has not answered the core for stall_timeout (True), or answers again."""
        self._set_stalled("data plane", stalled)

    def heartbeat(self) -> None:
        """The core is alive (the supervisor counts every message that arrives)."""

    # ---- from the supervisor --------------------------------------------------------------

    def core_hung(self, hung: bool) -> None:
        self._set_stalled("engine core", hung)

    def core_died(self) -> None:
        """NOT_SERVING until a new core connects; the requests in flight wait for it, unless they
        were in flight on MAX_CORES_PER_REQUEST cores that died."""
        self._connected = False
        self._stalls.clear()
        self._update_ready()
        core = self.core_snapshot
        for part in core.dataplanes:  # the next core counts each data plane's work from 0 again
            for name in DATAPLANE_COUNTERS:
                self.dataplane_counters_carried[part.target, name] += getattr(part, name)
        zeroed = dict.fromkeys(("waiting", "running", *DATAPLANE_COUNTERS), 0)
        # the totals carry on in earlier, which the next core is given (steps and computed tokens in stats)
        earlier = replace(core.earlier, num_preemptions=core.num_preemptions,
                          prefix_cache_queries=core.prefix_cache_queries, prefix_cache_hits=core.prefix_cache_hits)
        self.core_snapshot = replace(core, num_added=0, unrouted=0, added_by_frontend=(), waiting_by_frontend=(),
                                     earlier=earlier, dataplanes=[replace(d, **zeroed) for d in core.dataplanes])
        self._num_added = 0
        self._replay = True
        for state in list(self.requests.values()):
            if state.num_cores >= MAX_CORES_PER_REQUEST:
                error = NotReady(f"the control plane's engine core stopped {state.num_cores} times while it ran "
                                 "this request; retry later")
                self._fail(state, error, tell_core=False)

    def snapshot(self, snapshot: CoreSnapshot) -> None:
        self.core_snapshot = snapshot

    @property
    def dataplanes(self) -> list[DataPlaneSnapshot]:
        """Each data plane's share of the latest snapshot, its counters carried on from the engine cores
        before this one (GetStats and /metrics report these)."""
        carried = self.dataplane_counters_carried
        return [replace(part, **{name: getattr(part, name) + carried[part.target, name] for name in DATAPLANE_COUNTERS})
                for part in self.core_snapshot.dataplanes]

    def step(self, outputs: list[TokenOutput], snapshot: CoreSnapshot) -> None:
        """A step's tokens: detokenizes, applies stop strings and pushes each request's new output."""
        self.snapshot(snapshot)
        requests, limit = self.requests, self.config.max_unsent_tokens_per_stream
        touched: dict[int, RequestState] = {}  # a request's tokens of this step go out in one message
        for seq_id, token, position, logprobs, reason, num_cached, prompt_logprobs, scheduled_time in outputs:
            state = requests.get(seq_id)
            if state is None:  # ended here meanwhile (cancelled, stop string)
                continue
            touched[seq_id] = state
            state.record_token(token, position, logprobs, num_cached)
            if prompt_logprobs is not None:
                state.pending.prompt_logprobs = prompt_logprobs
            if scheduled_time is not None:
                state.scheduled_time = scheduled_time
            core_reason = reason and FinishReason(reason)
            reason = state.add_text(token, core_reason)
            if reason is not None:
                self._finish(state, reason, tell_core=core_reason is None)
        for state in touched.values():
            if not state.finished:
                state.emit()
            if state.unsent > limit:
                self._end_unread(state, f"max_unsent_tokens_per_stream {limit}")
        self._bound_unsent()

    def _bound_unsent(self) -> None:
        """Ends the streams furthest behind while all of them together hold too much unsent output
        (this frontend's share of max_unsent_tokens)."""
        limit, unsent = self.config.share(self.config.max_unsent_tokens), self.unsent
        while unsent.total > limit and unsent.streams:
            self._end_unread(unsent.furthest_behind(), f"all streams together over max_unsent_tokens {limit}"
                             + self._per_frontend)

    def step_failed(self, seq_ids: list[int], error: str) -> None:
        """A step the data plane could not run fails only the requests in it."""
        for seq_id in seq_ids:
            self._ended_by_core(seq_id, StepFailed(f"the data plane failed to run this request: {error}"))

    def refused(self, reasons: list[tuple[int, str]]) -> None:
        """Requests the core ended because the data plane it connected to can never hold them."""
        for seq_id, why in reasons:
            self._ended_by_core(seq_id, NoLongerFits(why))

    def rejected(self, seq_id: int, why: str) -> None:
        """A request the core could not put into a step plan: its values passed the checks here but
        not the plan's field types (a gap in those checks, which this keeps from taking the core down),
        or what constrains its tokens failed it while it ran (structured output's automaton outgrew its
        bound; its constraints left no token to write)."""
        self._ended_by_core(seq_id, InvalidRequest(why))

    def _ended_by_core(self, seq_id: int, error: ServiceError) -> None:
        """Fails a request the core has already dropped (unless it ended meanwhile)."""
        state = self.requests.get(seq_id)
        if state is not None:
            self._fail(state, error, tell_core=False)

    # ---- requests -----------------------------------------------------------------------

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; text and chat are tokenized in the tokenizer pool, off the event loop."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send the prompt as token ids, "
                                 "not as text or chat messages")
        if prompt.messages is not None:
            return await self.in_tokenizer_pool(self.tokenizer.encode_chat, prompt.messages, prompt.messages_name,
                                                prompt.chat_options, bool(prompt.add_special_tokens))
        return await self.in_tokenizer_pool(self.tokenizer.encode, prompt.text, prompt.add_special_tokens is not False)

    async def parse(self, function, *args):
        """A request's parse and checks, function(*args), on a tokenizer thread; the request counts as
        waiting meanwhile, so that a burst cannot queue more parses than max_waiting_requests allows."""
        self.num_tokenizing += 1
        try:
            return await self.in_tokenizer_pool(function, *args)
        finally:
            self.num_tokenizing -= 1

    async def in_tokenizer_pool(self, function, *args):
        """function(*args) on one of the tokenizer threads: work that grows with the input never
        holds up the event loop (streams, health)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, function, *args)

    async def outputs(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        """Yields a request's outputs until it finishes; leaving early aborts it.

        Outputs that queued up while the caller was still sending the previous one (a slow
        reader, a loaded server) go out merged into one: a stream that falls behind catches up
        with fewer, larger messages, and one that keeps up is never delayed.
        """
        try:
            while True:
                item = await state.next_output()
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.abort(state)

    def abort(self, state: RequestState) -> None:
        """Ends a request whose call ended (cancelled, deadline passed, done); frees its blocks now."""
        if not state.finished:
            self._finish(state, FinishReason.ABORTED)
        state.stream_closed()

    def _end_unread(self, state: RequestState, limit: str) -> None:
        """Aborts a request whose client does not read its stream, and ends its call."""
        error = StreamNotRead(f"the client did not read its stream: {state.unsent} tokens waited to be sent "
                              f"({limit}); the request was aborted")
        if not state.finished:
            self._ended(state, "error", f"error:{error.code_name}", tell_core=True)
        state.end_unread(error)

    async def wait_ready(self, queued: bool = False) -> None:
        """Returns once a data plane is connected; calls wait for it, up to their deadline.

        Queued calls (generations) count against max_waiting_requests while they wait, so an
        outage cannot pile up memory; they get RESOURCE_EXHAUSTED when there is no room.
        """
        if queued:
            self.check_room()
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

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued in the core (from every frontend), and this frontend's
        waiting for a data plane, being tokenized, on their way to the core, or waiting for a new
        core (every request in flight, once a core died)."""
        return self.core_snapshot.waiting + self._num_not_in_core

    @property
    def _num_not_in_core(self) -> int:
        core, own = self.core_snapshot, self.index
        added = core.added_by_frontend[own] if core.added_by_frontend else 0
        replaying = len(self.requests) if self._replay else 0  # all of them wait for the next core
        return self.num_waiting_ready + self.num_tokenizing + replaying + self._num_added - added

    @property
    def _per_frontend(self) -> str:
        n = self.config.api_server_count
        return f" (this frontend's share: {n} frontends split the limit)" if n > 1 else ""

    def check_room(self, count: int = 1) -> None:
        """Refuses count sequences (a request's choices) unless they fit beside this frontend's own waiting
        requests in its share of max_waiting_requests (all of it, with one frontend)."""
        if not self.accepting:
            raise NotReady("the server is shutting down")
        core = self.core_snapshot
        queued = core.waiting_by_frontend[self.index] if core.waiting_by_frontend else 0
        waiting, limit = queued + self._num_not_in_core, self.config.share(self.config.max_waiting_requests)
        if count > limit:
            raise InvalidRequest(f"the request asks for {count} sequences (its prompts times n); max_waiting_requests "
                                 f"{limit}{self._per_frontend} allows at most {limit} at once")
        if waiting + count > limit:
            raise Overloaded(f"too many waiting requests ({waiting}, max_waiting_requests {limit}"
                             f"{self._per_frontend}); retry later")

    async def add(self, call: GenerateCall, room_checked: bool = False,
                  arrival_time: float | None = None) -> RequestState:
        """Tokenizes and queues a validated request (call after wait_ready); returns its state.
        room_checked: check_room was asked for it with the rest of its request; arrival_time: when that
        request arrived (time.monotonic()), for a choice added after the others (default: now)."""
        return (await self.add_all([call], room_checked, arrival_time))[0]

    async def add_all(self, calls: list[GenerateCall], room_checked: bool = False,
                      arrival_time: float | None = None) -> list[RequestState]:
        """``add`` for the prompts of one request: each is tokenized and checked first, and all are queued
        only then, so a prompt refused leaves none of the others queued (or counted as aborted)."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        for call in calls:
            if call.params.regex is not None and self.tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer, to know each token's text; "
                                     "this server has none (start it with --tokenizer FOLDER)")
            if call.params.bad_words and self.tokenizer is None:
                raise InvalidRequest("bad_words needs the model's tokenizer, to know each word's tokens; this "
                                     "server has none (start it with --tokenizer FOLDER)")
        if not room_checked:
            self.check_room(len(calls))
        self.num_tokenizing += len(calls)
        try:
            checked = [await self._checked(call) for call in calls]
        finally:
            self.num_tokenizing -= len(calls)
        if not self.accepting:
            raise NotReady("the server is shutting down")
        states = []
        for name, prompt, params in checked:
            state = RequestState(next(self._seq_ids), name, prompt, params, self.tokenizer,
                                 self.config.stream_interval, self.metrics, arrival_time, self.unsent)
            self.requests[state.seq_id] = state
            if not self._replay:  # else the next core gets it with the others
                self._send_to_core(state)
            states.append(state)
        return states

    async def _checked(self, call: GenerateCall) -> tuple[str, list[int], RequestParams]:
        """A request's name, prompt tokens and parameters (max_tokens resolved, bad words tokenized)."""
        prompt = await self._prompt_tokens(call)
        if call.params.bad_words:  # their tokens, on the tokenizer threads as the prompt's, once it has room
            words = await self.in_tokenizer_pool(bad_words_ids, self.tokenizer, call.params.bad_words)
            call = replace(call, params=replace(call.params, bad_words_ids=words))
        return call.name, prompt, self._resolve_max_tokens(call.params, len(prompt), call.max_tokens_name)

    def _send_to_core(self, state: RequestState) -> None:
        state.num_cores += 1
        self._num_added += 1
        self.supervisor.send(messages.AddRequest(state.seq_id, state.request_id, state.prompt, state.params,
                                                 state.output_ids, state.num_cached_tokens))

    async def _prompt_tokens(self, call: GenerateCall) -> list[int]:
        prompt = await self.tokenize(call.prompt)
        if call.truncate_prompt_tokens and len(prompt) > call.truncate_prompt_tokens:
            prompt = prompt[-call.truncate_prompt_tokens:]
        if not prompt:
            raise InvalidRequest(f"{call.input_name}: the prompt is empty after tokenization; send at least one token")
        limit = self.limits.max_model_len
        if output_room(len(prompt), limit) < 1:
            raise InvalidRequest(f"{call.input_name}: the prompt has {len(prompt)} tokens; at most {limit - 1} fit "
                                 f"(max_model_len {limit}); shorten it or set truncate_prompt_tokens")
        return prompt

    def _resolve_max_tokens(self, params, num_prompt_tokens: int, name: str):
        """Checks max_tokens/min_tokens against the room the prompt leaves; fills in the default.
        ``name``: what the client's API calls max_tokens."""
        limit, kv_capacity = self.limits.max_model_len, self.kv_capacity
        room = output_room(num_prompt_tokens, limit)
        # unset: as many as fit in max_model_len and in the KV cache (one at least: a prompt that fills the
        # cache alone is refused below for that), at most the server's default
        fits = max(default_max_tokens(num_prompt_tokens, limit, kv_capacity), 1)
        default = min(fits, self.limits.defaults.get("max_tokens", fits))
        max_tokens = params.max_tokens or default
        too_many = misfit(num_prompt_tokens, max_tokens, limit, kv_capacity)
        if too_many is not None and too_many.limit is Limit.MAX_MODEL_LEN:
            raise InvalidRequest(f"{name}: prompt ({num_prompt_tokens} tokens) + {name} ({max_tokens}) "
                                 f"exceeds max_model_len ({limit}); set {name} <= {room}")
        if params.min_tokens > max_tokens:
            what = f"what fits after the {num_prompt_tokens}-token prompt" if max_tokens == fits else \
                "the server's default, from the model's generation config"
            raise InvalidRequest(f"min_tokens ({params.min_tokens}) must not exceed {name} ({max_tokens}, {what})")
        if too_many is not None:
            raise InvalidRequest(f"{name}: prompt + {name} ({too_many.needed} tokens) can "
                                 f"never fit in the KV cache ({too_many.available} tokens); lower it")
        return params if params.max_tokens else replace(params, max_tokens=max_tokens, max_tokens_unset=True)

    def _finish(self, state: RequestState, reason: FinishReason, tell_core: bool = True) -> None:
        state.emit(reason)
        self._ended(state, reason.value, reason.value, tell_core)

    def _fail(self, state: RequestState, error: ServiceError, tell_core: bool = True) -> None:
        state.fail(error)
        self._ended(state, "error", f"error:{error.code_name}", tell_core)

    def _ended(self, state: RequestState, ending: str, outcome: str, tell_core: bool) -> None:
        """A request that ended leaves the requests in flight, counted (ending: its metrics label) and
        logged (outcome); tell_core: the core still schedules it, so it frees its blocks."""
        self.requests.pop(state.seq_id, None)
        if tell_core:
            self.supervisor.send(messages.Abort(state.seq_id))
        self.metrics.request_finished(ending, state, time.monotonic())
        request_log.info(state.summary(outcome))


async def first_of(*events: asyncio.Event) -> None:
    """Waits until any of events is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _wait_until(done: Callable[[], bool], timeout: float, interval: float) -> None:
    """Polls done every interval seconds until it holds or timeout seconds have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done() and loop.time() < deadline:
        await asyncio.sleep(interval)
