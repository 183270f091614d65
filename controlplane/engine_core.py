"""The engine core: the step loops (schedule -> StepPlan -> data plane -> update), in a process of its own.

The core owns every Sequence and, for each data plane it drives, a Scheduler and a
BlockManager (``replica.py``). It gets new requests and aborts from the frontend
(``Engine``, in the gRPC server's process), routes each new sequence to a data plane
(``router.py``) and sends back, once per step, the sampled tokens with the finish
reasons that token rules decide (stop token, length). Text, stop strings and streaming
are the frontend's, so however many clients stream, this process only plans steps and
the data planes never wait on the gRPC server's work.

When a data plane is lost, its sequences go back to the core, which recomputes them on
the data planes still connected (or on the same one once it is back), as after a
preemption: no request is lost. A data plane that stops answering counts as lost after
``dataplane_timeout``; before that, once ``stall_timeout`` passes, it counts as stalled (the
frontend reports NOT_SERVING while every connected data plane is). The core sends the frontend
a heartbeat every ``HEARTBEAT_INTERVAL`` seconds, busy or idle.

With several frontend processes (``frontends.py``) the core has a channel to each; it sends each
sequence's tokens to the frontend that added it, and the rest to all (``fanout.py``). What crosses
a channel either way is in ``messages.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import subprocess
import threading
from collections import deque
from dataclasses import replace

from twinplane.controlplane import event_loop
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.fanout import Frontends, owner
from twinplane.controlplane.finish import Limit, default_max_tokens, misfit, stop_token_ids
from twinplane.controlplane.grammar import Grammar
from twinplane.controlplane.ipc import Channel, child_argv, start_process
from twinplane.controlplane.liveness import ticks
from twinplane.controlplane.messages import (Abort, AddRequest, Configure, Connected, CoreMessage, CoreSnapshot,
                                             DataPlaneSnapshot, Heartbeat, Lost, Refused, Rejected, Shutdown,
                                             Snapshot, Stalled)
from twinplane.controlplane.plan_codec import sequence_init
from twinplane.controlplane.replica import STAT_NAMES, Replica
from twinplane.controlplane.router import Router
from twinplane.controlplane.sequence import RequestParams, Sequence
from twinplane.controlplane.structured import (AllOf, BannedWords, FixedTokens, TokenMatcher, Vocabulary,
                                               compile_shared, compiled, token_bits)
from twinplane.controlplane.tokenizer import Tokenizer
from twinplane.controlplane.tools import TAGS
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import set_fields

GRAMMARS_KEPT = 64  # compiled grammars the core keeps at hand (the latest)
log = logging.getLogger("twinplane.controlplane")

def never_fits(seq: Sequence, desc: dp.DescribeResponse) -> str | None:
    """Why a data plane described by desc can never run seq to its max_tokens (None: it can)."""
    too_many = misfit(seq.num_prompt_tokens, seq.params.max_tokens, desc.max_model_len,
                      desc.num_kv_blocks * desc.block_size)
    if too_many is None:
        return None
    if too_many.limit is Limit.MAX_MODEL_LEN:
        where = f"exceeds the data plane's max_model_len ({too_many.available})"
    else:
        where = f"no longer fits in the data plane's KV cache ({too_many.available} tokens)"
    return (f"prompt + max_tokens ({too_many.needed} tokens) {where}, which shrank while the request ran; "
            "send it again with fewer tokens")


# What every data plane of one control plane must have alike: the model (by its shapes, as its name or
# path may differ between hosts), dtype and KV-cache dtype, so that a sequence recomputed on another one
# goes on as it would have; its end-of-sequence tokens and generation config (the frontends' defaults come
# from one of them); and the block size that prefix routes hash by.
SAME_MODEL = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "dtype", "eos_token_ids", "generation_config", "block_size", "kv_cache_dtype")


def model_differences(desc: dp.DescribeResponse, reference: dp.DescribeResponse) -> list[str]:
    """What desc has unlike reference, of SAME_MODEL (empty: the same model)."""
    def value(d, name):
        v = getattr(d, name)
        if name == "generation_config":
            return set_fields(v)
        return list(v) if name == "eos_token_ids" else v
    return [f"{name} {value(desc, name)!r} (the others: {value(reference, name)!r})" for name in SAME_MODEL
            if value(desc, name) != value(reference, name)]


def common_describe(descs: list[dp.DescribeResponse]) -> dp.DescribeResponse:
    """What the frontend checks requests against: the limits every connected data plane meets."""
    common = dp.DescribeResponse()
    common.CopyFrom(descs[0])
    common.max_model_len = min(d.max_model_len for d in descs)
    common.num_kv_blocks = min(d.num_kv_blocks * d.block_size for d in descs) // common.block_size
    common.max_logprobs = min(d.max_logprobs for d in descs)
    common.max_num_seqs = min(d.max_num_seqs for d in descs)  # reported in ModelInfo as the smallest's
    common.max_num_batched_tokens = min(d.max_num_batched_tokens for d in descs)
    return common


class EngineCore:
    def __init__(self, config: ControlPlaneConfig, frontend, counters: CoreSnapshot | None = None,
                 on_connected=lambda: None):
        """frontend: where messages to the frontends go (fanout.Frontends.send); counters: the last
        snapshot of the core this one replaces, whose counters it carries on; on_connected(): called
        once a data plane has connected and its KV blocks are allocated."""
        self.config = config
        self.frontend = frontend
        self.on_connected = on_connected
        self.replicas = [Replica(i, target, self) for i, target in enumerate(config.dataplanes)]
        self.router = Router(config.routing)
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences
        self.replica_of: dict[int, Replica] = {}  # where each routed sequence runs
        self.unrouted: deque[Sequence] = deque()  # sequences waiting for any data plane to connect
        # structured-output sequences waiting for the vocabulary or their grammar, with their output so far
        self.preparing: list[tuple[Sequence, list[int]]] = []
        self.describe: dp.DescribeResponse | None = None  # the connected data planes' common limits
        self.eos_token_ids: frozenset[int] = frozenset()
        self.stopped = asyncio.Event()
        self.num_added = 0
        self.added_by_frontend = [0] * config.api_server_count
        self.carried = counters or CoreSnapshot(dict.fromkeys(STAT_NAMES, 0))  # from the cores before this one
        self.earlier = DataPlaneSnapshot("earlier cores", num_preemptions=self.carried.num_preemptions,
                                         prefix_cache_queries=self.carried.prefix_cache_queries,
                                         prefix_cache_hits=self.carried.prefix_cache_hits)
        self.dataplane_step = self.carried.dataplane_step
        self._stalled = False  # the frontend was told every connected data plane stalled
        self._vocabulary: concurrent.futures.Future | None = None  # read once a data plane connects
        # grammars compiled off the step loop (a schema's can take 0.1-1 s), by regex: the latest ones
        self._grammars: dict[str, concurrent.futures.Future] = {}
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="twinplane-grammar")

    # ---- messages from the frontends ----------------------------------------------------

    def receive(self, message: CoreMessage) -> None:
        """Applies a frontend's message (Configure comes before the core exists: see _serve_core)."""
        match message:
            case AddRequest():
                self.add(message)
            case Abort(seq_id):
                self.abort(seq_id)
            case Shutdown():
                self.shutdown()
            case _:
                raise AssertionError(f"unexpected message for the engine core: {message!r}")

    def add(self, request: AddRequest) -> None:
        """A new request; or one a previous core had started (its tokens so far), to recompute."""
        seq_id, params = request.seq_id, request.params
        self.num_added += 1
        self.added_by_frontend[owner(seq_id, self.config.api_server_count)] += 1
        seq = Sequence(seq_id, request.request_id, request.prompt, params)
        try:  # what its plans will carry, once: a value they cannot hold fails this request, not the core
            sequence_init(seq, self.eos_token_ids, 0)
        except (ValueError, TypeError) as exc:
            log.error("request %s: its values cannot be put into a step plan: %s", request.request_id, exc)
            self.frontend.send(Rejected(seq_id, f"a value of this request is outside what the data plane takes: {exc}"))
            return
        seq.token_ids += request.output_ids
        seq.num_cached_tokens = request.num_cached_tokens
        seq.stop_ids = stop_token_ids(params, self.eos_token_ids)
        self.seqs[seq_id] = seq
        if params.regex is not None and not self._prepared(params.regex):
            self.preparing.append((seq, request.output_ids))  # it waits, the steps do not
        else:
            self._constrain(seq, request.output_ids)

    def _prepared(self, regex: str) -> bool:
        """Whether a sequence constrained by regex can be given its matcher now: the vocabulary has been read
        (or failed to be, or no data plane has connected, which ``_constrain`` reports) and the grammar compiled;
        the compilation starts, off the step loop, if it has not."""
        if self._vocabulary is None:
            return True
        future = self._grammars.get(regex)
        crowded = future is not None and future.done() and future.exception() is None and future.result().crowded
        if future is None or crowded:  # a crowded automaton is left to the sequences in it; new ones get their own
            future = self._grammars[regex] = self._compiler.submit(Grammar.from_regex if crowded else compiled, regex)
            loop = asyncio.get_running_loop()
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._preparations_done))
            while len(self._grammars) > GRAMMARS_KEPT and next(iter(self._grammars.values())).done():
                del self._grammars[next(iter(self._grammars))]
        return self._vocabulary.done() and future.done()

    def _constrain(self, seq: Sequence, output_ids: list[int]) -> None:
        """Gives a sequence what constrains its tokens (structured output: its place in its grammar after
        output_ids; allowed_token_ids; bad_words), if anything does, and routes it."""
        if seq.params.constrained:
            try:
                seq.matcher = self._matcher(seq.params, output_ids)
            except (ValueError, OSError) as exc:  # checked by the frontend: a tokenizer the core cannot read
                log.error("request %s: its tokens cannot be constrained: %s", seq.request_id, exc)
                del self.seqs[seq.seq_id]
                self.frontend.send(Rejected(seq.seq_id, f"what constrains its tokens is not available: {exc}"))
                return
        self._route(seq)

    def _matcher(self, params: RequestParams, output_ids: list[int]):
        """What a request's constraints allow it to sample, after output_ids: the one constraint's matcher, or
        all of them together (ValueError before a data plane has described the model)."""
        if self.describe is None:
            raise ValueError("no data plane has connected yet")
        vocab_size = self.describe.vocab_size
        parts = [FixedTokens(params.allowed_token_ids, vocab_size)] if params.allowed_token_ids else []
        if params.bad_words_ids:
            parts.append(BannedWords(params.bad_words_ids, vocab_size, output_ids))
        if params.regex is not None:
            vocabulary, grammar = self.vocabulary(), self._grammars.get(params.regex)
            grammar = grammar.result() if grammar is not None else compiled(params.regex)
            parts.append(TokenMatcher(grammar, vocabulary, output_ids))
        if len(parts) == 1:
            return parts[0]
        return AllOf(parts, token_bits([t for t in self.eos_token_ids if t < vocab_size], vocab_size))

    def _preparations_done(self) -> None:
        """The sequences whose vocabulary and grammar are ready go on (those not aborted meanwhile)."""
        waiting, self.preparing = self.preparing, []
        for seq, output_ids in waiting:
            if seq.seq_id not in self.seqs:
                continue
            if self._prepared(seq.params.regex):
                self._constrain(seq, output_ids)
            else:
                self.preparing.append((seq, output_ids))

    def vocabulary(self) -> Vocabulary:
        """Every token's bytes, for structured output's masks (ValueError or OSError when there is no
        tokenizer to read them from)."""
        if self._vocabulary is None:
            raise ValueError("no data plane has connected yet")
        return self._vocabulary.result()

    def _read_vocabulary(self) -> None:
        """Reads every token's bytes off the step loop, once the first data plane has described the model:
        the first request with structured output then finds them ready instead of stalling every step."""
        future = self._vocabulary = concurrent.futures.Future()
        folder = self.config.tokenizer or self.describe.tokenizer_path
        tags = TAGS[self.config.tool_call_parser] if self.config.tool_call_parser else ()
        vocab_size, eos_token_ids = self.describe.vocab_size, self.eos_token_ids

        def read() -> None:
            try:
                if not folder:
                    raise ValueError("the model has no tokenizer; start the control plane with --tokenizer")
                future.set_result(Vocabulary(Tokenizer(folder), vocab_size, eos_token_ids, tags))
            except Exception as exc:  # given to each request that asks for structured output
                future.set_exception(exc if isinstance(exc, (ValueError, OSError)) else
                                     ValueError(f"the tokenizer could not be read: {type(exc).__name__}: {exc}"))
                return
            compile_shared(self.config.reasoning_parser)

        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._preparations_done))
        threading.Thread(target=read, daemon=True, name="twinplane-vocabulary").start()

    def abort(self, seq_id: int) -> None:
        """The sequence ended (the frontend cancelled it, a stop string or a token rule ended it, what
        constrains its tokens failed it): its blocks are free now, and nothing waits for it."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        replica = self.replica_of.pop(seq_id, None)
        if replica is not None:
            replica.finish(seq)
        elif seq in self.unrouted:
            self.unrouted.remove(seq)
        else:  # waiting for the vocabulary or its grammar
            self.preparing = [entry for entry in self.preparing if entry[0] is not seq]

    def shutdown(self) -> None:
        self.stopped.set()

    def frontend_gone(self, index: int) -> None:
        """A frontend's channel closed: nobody reads its sequences' outputs any more."""
        count = self.config.api_server_count
        for seq_id in [seq_id for seq_id in self.seqs if owner(seq_id, count) == index]:
            self.abort(seq_id)

    # ---- routing ------------------------------------------------------------------------

    def refusal(self, replica: Replica, desc: dp.DescribeResponse) -> str | None:
        """Why replica may not drive the data plane that desc describes (None: it may): one that another
        replica drives already (reached by a second address), or one whose model differs from the
        data planes that the others drive (or connect to, checked)."""
        others = [r for r in self.replicas if r is not replica and r.claimed is not None]
        for other in others:
            if desc.instance_id and desc.instance_id == other.claimed.instance_id:
                return (f"it is the data plane that {other} drives already: give each data plane one address "
                        "(this one is left alone)")
        if others and (differences := model_differences(desc, others[0].claimed)):
            return (f"it serves another model than the other data planes: {'; '.join(differences)}. Every data "
                    "plane of one control plane must serve the same model in the same dtype and KV-cache dtype with "
                    "the same block size")
        return None

    def _route(self, seq: Sequence) -> None:
        """Gives seq to a connected data plane that can hold it (one that answers, while any does). With
        none that can, it waits for one that could and is not connected now (as with none connected), or
        is refused."""
        live = [r for r in self.replicas if r.connected]
        if not live:
            self.unrouted.append(seq)
            return
        able = [r for r in live if never_fits(seq, r.describe) is None]
        if not able and any(never_fits(seq, r.describe) is None for r in self.replicas
                            if not r.connected and r.describe is not None):
            self.unrouted.append(seq)
            return
        if not able and seq.params.max_tokens_unset:  # as many as fit: fewer, on data planes that came back smaller
            room = max(default_max_tokens(seq.num_prompt_tokens, r.describe.max_model_len, r.capacity) for r in live)
            if seq.num_output_tokens < room:
                seq.params = replace(seq.params, max_tokens=room)
                able = [r for r in live if never_fits(seq, r.describe) is None]
        if not able:
            del self.seqs[seq.seq_id]
            why = never_fits(seq, max(live, key=lambda r: r.capacity).describe)
            self.frontend.send(Refused([(seq.seq_id, why)]))
            return
        able = [r for r in able if not r.stalled] or able
        replica = able[0] if len(self.replicas) == 1 else self.router.pick(seq, able)
        self.replica_of[seq.seq_id] = replica
        replica.add(seq)

    def connections_changed(self, connected: bool) -> None:
        """A data plane connected (connected) or was lost: the frontend hears the new limits (or
        NOT_SERVING), and sequences that waited for any data plane are routed."""
        if connected:
            self.on_connected()
        self._tell_frontend()
        if any(r.connected for r in self.replicas):
            waiting, self.unrouted = self.unrouted, deque()
            for seq in waiting:
                self._route(seq)

    def recompute(self, replica: Replica, seqs: list[Sequence]) -> None:
        """A data plane is gone with its KV cache: its sequences are recomputed elsewhere (or there, once back)."""
        self.router.forget(replica.index)
        moved = [seq for seq in seqs if seq.seq_id in self.seqs]
        if moved:
            log.warning("recomputing %d sequences of %s", len(moved), replica)
        for seq in moved:
            del self.replica_of[seq.seq_id]
            self._route(seq)
        self.frontend.send(Snapshot(self.snapshot()))  # its gauges: those sequences moved, its blocks free

    def _tell_frontend(self) -> None:
        """NOT_SERVING once no data plane is connected; otherwise the limits they all meet."""
        live = [r.describe for r in self.replicas if r.connected]
        self._stalled = False  # lost() and connected() both end a stall on the frontend
        if not live:
            self.frontend.send(Lost())
            return
        self.describe = common_describe(live)
        self.eos_token_ids = frozenset(self.describe.eos_token_ids)
        if self._vocabulary is None:
            self._read_vocabulary()
        self.frontend.send(Connected(self.describe, self.snapshot()))
        self.stalls_changed()

    def stalls_changed(self) -> None:
        """The frontend reports NOT_SERVING while every connected data plane has stalled."""
        live = [r for r in self.replicas if r.connected]
        stalled = bool(live) and all(r.stalled for r in live)
        if stalled != self._stalled:
            self._stalled = stalled
            self.frontend.send(Stalled(stalled))

    def snapshot(self) -> CoreSnapshot:
        unrouted = len(self.unrouted) + len(self.preparing)
        snap = CoreSnapshot(dict(self.carried.stats), self.num_added, unrouted, earlier=self.earlier,
                            dataplane_step=self.dataplane_step, dataplanes=[replica_snapshot(r) for r in self.replicas])
        for replica in self.replicas:
            for name, value in replica.stats.items():
                snap.stats[name] += value
        snap.added_by_frontend = tuple(self.added_by_frontend)
        snap.waiting_by_frontend = self._waiting_by_frontend(snap.waiting)
        return snap

    def _waiting_by_frontend(self, waiting: int) -> tuple[int, ...]:
        count = self.config.api_server_count
        if count == 1:
            return (waiting,)
        shares = [0] * count
        queues = [self.unrouted, [seq for seq, _ in self.preparing],
                  *(r.scheduler.waiting for r in self.replicas if r.scheduler is not None)]
        for queue in queues:
            for seq in queue:
                shares[owner(seq.seq_id, count)] += 1
        return tuple(shares)

    # ---- the step loops -----------------------------------------------------------------

    async def run(self) -> None:
        """Runs every data plane's step loop until shutdown(), and heartbeats meanwhile; an
        unexpected error in one loop ends them all."""
        loops = [asyncio.create_task(r.run(), name=f"twinplane-step-loop-{r.index}") for r in self.replicas]
        stopped = asyncio.create_task(self.stopped.wait())
        watch = asyncio.create_task(self._watch())
        try:
            done, _ = await asyncio.wait((*loops, stopped), return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                task.result()  # a loop only ends by an error: raise it
        finally:
            for task in (*loops, stopped, watch):
                task.cancel()
            await asyncio.gather(*loops, watch, return_exceptions=True)
            for replica in self.replicas:
                await replica.close()


    async def _watch(self) -> None:
        """Every tick: a heartbeat to the frontend, and each step loop's wait on its data plane checked."""
        async for elapsed in ticks():
            self.frontend.send(Heartbeat())
            for replica in self.replicas:
                replica.check_wait(elapsed)


def replica_snapshot(replica: Replica) -> DataPlaneSnapshot:
    sched = replica.scheduler
    part = DataPlaneSnapshot(replica.target, replica.connected, steps=replica.stats["steps"],
                             computed_tokens=replica.stats["computed_tokens"])
    if sched is not None:
        bm = sched.block_manager
        part.waiting, part.running, part.num_preemptions = len(sched.waiting), len(sched.running), sched.num_preemptions
        if replica.connected:  # a lost data plane's KV cache is none to count, free or used
            part.free_kv_blocks, part.num_kv_blocks = bm.num_free_blocks, bm.num_blocks
        part.prefix_cache_queries, part.prefix_cache_hits = sched.num_prefix_cache_queries, sched.num_prefix_cache_hits
    return part


# ---- the core's process ---------------------------------------------------------------------


def start_core_process(config: ControlPlaneConfig) -> tuple[subprocess.Popen, socket.socket, list[socket.socket]]:
    """Starts the engine core in a child process; returns it, frontend 0's end of their channel, and
    the other frontends' ends (for frontends.Secondaries to hand over).

    The child gets its end of one socketpair per frontend as inherited file descriptors; frontend
    0's first message on its channel must be ``Configure`` (so no secret shows on a command line).
    """
    pairs = [socket.socketpair() for _ in range(config.api_server_count)]
    core_ends = [core_end for _, core_end in pairs]
    fds = [end.fileno() for end in core_ends]
    try:
        process = start_process(__name__, [str(fd) for fd in fds], fds)  # see main()
    finally:
        for end in core_ends:
            end.close()
    return process, pairs[0][0], [frontend_end for frontend_end, _ in pairs[1:]]


def main() -> None:
    """The engine core's process: ``main()`` with argv [one socket fd per frontend, log level]."""
    # Ctrl-C or SIGTERM to the whole process group is ignored: the frontend shuts the core down in
    # order (a Shutdown message, or the channel closing when the frontend is gone).
    fds, _ = child_argv()
    event_loop.run(_serve_core([socket.socket(fileno=int(fd)) for fd in fds]))


async def _serve_core(socks: list[socket.socket]) -> None:
    """Runs the core until frontend 0 says shutdown or goes away."""
    channels = [Channel(sock) for sock in socks]
    for channel in channels:
        await channel.open()
    first = await channels[0].receive()
    if first is None:
        for channel in channels:
            channel.close()
        return  # the frontend went away before it said anything
    assert isinstance(first, Configure), f"the engine core's first message must be Configure, got {first!r}"
    # the KV blocks of each data plane that connects are kept until it is lost: out of the collector's way
    core = EngineCore(first.config, Frontends(channels), first.counters,
                      on_connected=lambda: event_loop.freeze_heap("engine core"))
    serving = [asyncio.create_task(_serve_frontend(core, index, channel)) for index, channel in enumerate(channels)]
    serving[0].add_done_callback(lambda _: core.shutdown())  # frontend 0 is gone: nobody to serve
    try:
        await core.run()
    except Exception:
        log.critical("the control plane's engine core stopped on an unexpected error", exc_info=True)
        raise SystemExit(1) from None  # the traceback is logged: not a second copy from the interpreter
    finally:
        for task in serving:
            task.cancel()
        for channel in channels:
            channel.close()


async def _serve_frontend(core: EngineCore, index: int, channel: Channel) -> None:
    """Applies a frontend's messages until its channel closes; then its sequences end."""
    await channel.serve(core.receive)
    channel.close()
    core.frontend_gone(index)
