"""The data plane's gRPC server: Describe, Step (one result per plan, in order), Reset.

One Step stream is served at a time: a newer one (or a Reset) ends the older one with
ABORTED and takes over, so a control plane that restarts never waits behind a stale
stream. With a token, every call but a health check must send it (metadata
``x-twinplane-token``) and is refused before it takes any lock; calls beyond
``MAX_CONCURRENT_CALLS`` get RESOURCE_EXHAUSTED at once rather than queueing for a thread.

A Step stream's plans are launched as soon as they arrive,
so the device already holds the next step when the current one ends: a reader thread
queues incoming plans, a watcher thread reports each launched step as it finishes on
the device, and the stream's handler launches plans and sends results in plan order
as those events come in. A plan that fails is answered with an error result for that
step only, and the process keeps serving.

At DEBUG, logger ``twinplane.dataplane.steps`` writes one line per step with its host
timeline: how long the plan waited for the handler, how long launching took, and how
long before the previous step finished it was launched (negative: the device waited).
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
import uuid
from collections import deque
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from twinplane.controlplane.tls import add_port  # grpc only: the address checks both planes share
from twinplane.dataplane.convert import describe_to_pb, masks_from_pb, output_to_pb, plan_from_pb
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

log = logging.getLogger("twinplane.dataplane")
step_log = logging.getLogger("twinplane.dataplane.steps")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
TOKEN_HEADER = "x-twinplane-token"
# The control plane pings to find a silent data plane: accept its pings (every second at most). Pinging
# back closes the connection of a control plane that went silent (a dead host, a lost network), so its
# Step stream stops holding the lock that a new control plane's Reset and Step wait for.
KEEPALIVE_OPTIONS = [("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0),
                     ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                     ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 30_000),
                     ("grpc.http2.ping_timeout_ms", 30_000)]
MAX_CONCURRENT_CALLS = 16  # one thread each; more get RESOURCE_EXHAUSTED
# gRPC binds with SO_REUSEPORT unless told not to: a second data plane on a port in use would start and
# take half of its connections (a stale one answering a new control plane) instead of failing to bind
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
OPEN_METHODS = ("/grpc.health.v1.Health/Check",)  # probes need no token
SUPERSEDED = "a newer Step stream took over this data plane"
UNREADABLE = "message {} of the Step stream is no StepPlan ({}); the stream ends"
TAKEOVER_POLL_S = 0.05


def _deny(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong data-plane token")


_DENY = {  # (request_streaming, response_streaming) -> handler
    (False, False): grpc.unary_unary_rpc_method_handler(_deny),
    (False, True): grpc.unary_stream_rpc_method_handler(_deny),
    (True, False): grpc.stream_unary_rpc_method_handler(_deny),
    (True, True): grpc.stream_stream_rpc_method_handler(_deny),
}


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but a health check that does not send the token (constant-time comparison)."""

    def __init__(self, token: str):
        self._expected = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_METHODS:
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return handler
        return _DENY[(handler.request_streaming, handler.response_streaming)]


class DataPlaneServicer(dp_grpc.DataPlaneServicer):
    def __init__(self, runner, workers=None):
        self.runner = runner
        self.workers = workers  # TensorParallelWorkers, or None with one rank
        self.lock = threading.Lock()  # held by the Step stream, a Reset, or close()
        self._pipeline: _StepPipeline | None = None  # the Step stream holding the lock
        self.instance_id = uuid.uuid4().hex  # Describe's: this data plane's own, whatever address reached it

    def Describe(self, request, context) -> dp.DescribeResponse:
        desc = describe_to_pb(self.runner.describe())
        desc.instance_id = self.instance_id
        return desc

    def _take_over(self) -> None:
        """Takes the lock, ending the Step stream that holds it (the newest session wins)."""
        while True:
            if (pipeline := self._pipeline) is not None:
                pipeline.supersede()
            if self.lock.acquire(timeout=TAKEOVER_POLL_S):
                return

    def close(self, timeout: float = 10.0) -> None:
        """Stops the tensor-parallel workers and releases the runner once no Step stream uses them
        any more (call after the server stopped: a stream's handler may still be launching a plan)."""
        idle = self.lock.acquire(timeout=timeout)
        if not idle:
            log.warning("a Step stream is still running after %.0f s; releasing the runner anyway", timeout)
        try:
            if self.workers is not None:
                self.workers.stop()
            self.runner.close()
        finally:
            if idle:
                self.lock.release()

    def Reset(self, request, context) -> dp.ResetResponse:
        self._take_over()
        try:
            self._reset()
        finally:
            self.lock.release()
        return dp.ResetResponse()

    def _reset(self) -> None:
        if self.workers is not None:
            self.workers.reset()
        self.runner.reset()

    def Step(self, request_iterator, context):
        self._take_over()
        pipeline = _StepPipeline(self._launch, lambda: self.runner.awaits_masks)
        try:
            self._reset()  # a new stream means a new control-plane session
            self._pipeline = pipeline
            yield from pipeline.run(request_iterator)
        finally:
            self._pipeline = None
            self.lock.release()
        if pipeline.superseded:
            log.warning("a newer Step stream took over; the older one ends with ABORTED")
            context.abort(grpc.StatusCode.ABORTED, SUPERSEDED)
        if pipeline.unreadable is not None:
            log.error("%s", pipeline.unreadable)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, pipeline.unreadable)

    def _launch(self, msg: dp.StepPlan):
        """Queues a plan on the device (a masks_only message: the sampling of the plan that waits for
        them); returns its LaunchedStep, or a StepResult if it failed."""
        try:
            if self.workers is not None:
                self.workers.step(msg.SerializeToString())
            if msg.masks_only:
                return self.runner.sample_with_masks(msg.step_id, masks_from_pb(msg))
            return self.runner.launch(plan_from_pb(msg))
        except Exception as exc:  # the step fails, the process keeps serving
            self.runner.drop_refused(msg.dropped_seq_ids)
            return _failed(msg.step_id, exc)


def _failed(step_id: int, exc: Exception) -> dp.StepResult:
    log.error("step %d failed: %s: %s", step_id, type(exc).__name__, exc, exc_info=not isinstance(exc, ValueError))
    return dp.StepResult(step_id=step_id, error=f"{type(exc).__name__}: {exc}")


class _Unreadable:
    """In place of a Step message that does not parse as a StepPlan (see _add_servicer): what is wrong."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _plan_or_unreadable(data: bytes) -> dp.StepPlan | _Unreadable:
    try:
        return dp.StepPlan.FromString(data)
    except DecodeError as exc:
        return _Unreadable(str(exc))


_FINISHED = object()  # the watcher saw the oldest launched step finish
_SUPERSEDED = object()  # a newer stream wants the device: stop taking plans


class _StepPipeline:
    """Launches each plan on arrival and yields the results in order as steps finish. A plan whose token
    masks follow is watched once they have come and its sampling is queued; plans that come before
    them wait (the control plane sends none: the masks come next)."""

    def __init__(self, launch, awaits_masks=lambda: False) -> None:
        self.launch = launch
        self.awaits_masks = awaits_masks  # () -> whether the last plan launched waits for its masks
        self.awaiting: list | None = None  # its entry in run's launched: [step, times]
        self.held: deque = deque()  # (plan, time it came) that came while a plan waited for its masks
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # plans, _FINISHED, _SUPERSEDED, or None (ended)
        self.to_watch: queue.SimpleQueue = queue.SimpleQueue()
        self.superseded = False
        self.unreadable: str | None = None  # why the stream ends: a message that was no StepPlan

    def supersede(self) -> None:
        """Ends run() once the steps already launched are done (called from another thread)."""
        self.events.put((_SUPERSEDED, time.perf_counter()))

    def run(self, requests):
        threading.Thread(target=self._read, args=(requests,), daemon=True, name="twinplane-plans").start()
        threading.Thread(target=self._watch, daemon=True, name="twinplane-watch").start()
        launched = deque()
        debug = step_log.isEnabledFor(logging.DEBUG)
        previous_finished = 0.0  # host time the watcher saw the previous step finish
        try:
            while (event := self.events.get()) is not None:
                what, at = event
                if what is _SUPERSEDED:
                    self.superseded = True
                    return
                if isinstance(what, _Unreadable):  # take no more plans; the results due still go out
                    self.unreadable = what.reason
                    break
                if what is _FINISHED:
                    step, times = launched.popleft()
                    if debug:
                        _log_timeline(step, times, previous_finished, at)
                    previous_finished = at
                    yield self._result(step)
                    continue
                if self.awaiting is not None and not what.masks_only:
                    self.held.append((what, at))
                    continue
                self._start(what, at, launched)
                while self.held and self.awaiting is None:
                    self._start(*self.held.popleft(), launched)
            while launched:  # no more plans: the results still due, in order
                yield self._result(launched.popleft()[0])
        finally:
            self.to_watch.put(None)
            for step, _ in launched:  # the stream is gone; let queued device work end before the next one
                if not isinstance(step, dp.StepResult):
                    step.wait()

    def _start(self, msg: dp.StepPlan, at: float, launched: deque) -> None:
        if msg.masks_only and (self.awaiting is None or self.awaiting[0].step_id != msg.step_id):
            # their plan failed at launch, or they name another step: the one waiting keeps waiting for its own
            log.debug("token masks for step %d, which waits for none", msg.step_id)
            return
        started = time.perf_counter()
        step = self.launch(msg)
        if msg.masks_only:
            self.awaiting[0] = step  # the same step, its sampling queued, or the StepResult of its failure
            self.awaiting = None
        else:
            launched.append([step, (at, started, time.perf_counter())])
            if self.awaits_masks():
                self.awaiting = launched[-1]
                return
        self.to_watch.put(step)

    @staticmethod
    def _result(step) -> dp.StepResult:
        if isinstance(step, dp.StepResult):  # failed at launch
            return step
        try:
            return output_to_pb(step.result())
        except Exception as exc:
            return _failed(step.step_id, exc)

    def _read(self, requests) -> None:
        try:
            for count, msg in enumerate(requests, start=1):
                if isinstance(msg, _Unreadable):
                    self.events.put((_Unreadable(UNREADABLE.format(count, msg.reason)), time.perf_counter()))
                    return
                self.events.put((msg, time.perf_counter()))
        except Exception:  # the stream was cancelled or broke: end it
            pass
        finally:
            self.events.put(None)

    def _watch(self) -> None:
        while (step := self.to_watch.get()) is not None:
            if not isinstance(step, dp.StepResult):
                try:
                    step.wait()
                except Exception:  # a device fault: result() reports it
                    pass
            self.events.put((_FINISHED, time.perf_counter()))


def _log_timeline(step, times: tuple[float, float, float], previous_finished: float, finished: float) -> None:
    arrived, started, launched = times
    if isinstance(step, dp.StepResult):
        return
    previous_finished = previous_finished or launched  # the stream's first step
    step_log.debug("step %d: plan waited %d us, launch %d us (prepare %d us, forward %d us, sample %d us), launched "
                   "%d us before the previous step finished, ran %d us after it", step.step_id,
                   (started - arrived) * 1e6, (launched - started) * 1e6, step.prepare_us, step.forward_us,
                   step.sample_us, (previous_finished - launched) * 1e6,
                   (finished - max(previous_finished, launched)) * 1e6)


def _add_servicer(servicer: DataPlaneServicer, server: grpc.Server) -> None:
    """dp_grpc.add_DataPlaneServicer_to_server, but Step's messages are parsed by a function that cannot fail:
    one that is no StepPlan reaches the stream as an _Unreadable. grpc's own parse failure of a message of a
    streaming request leaves that call unfinished inside the server (grpcio 1.85), so server.stop() would never
    return and the data plane would never exit on SIGTERM."""
    def unary(method, request, response):
        return grpc.unary_unary_rpc_method_handler(method, request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)

    handlers = {
        "Describe": unary(servicer.Describe, dp.DescribeRequest, dp.DescribeResponse),
        "Step": grpc.stream_stream_rpc_method_handler(servicer.Step, request_deserializer=_plan_or_unreadable,
                                                      response_serializer=dp.StepResult.SerializeToString),
        "Reset": unary(servicer.Reset, dp.ResetRequest, dp.ResetResponse),
    }
    service = dp.DESCRIPTOR.services_by_name["DataPlane"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _add_health(server: grpc.Server) -> None:
    """grpc.health.v1, SERVING from the start: a data plane serves only once its model is loaded."""
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)


def create_server(runner, listen: str, token: str | None = None, workers=None,
                  credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int, DataPlaneServicer]:
    """Builds the data-plane server (not started), over TLS with credentials; returns it, the bound
    port (0 for unix sockets) and the servicer (whose ``close`` releases the runner after the server
    stopped)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *KEEPALIVE_OPTIONS, EXCLUSIVE_PORT]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_CONCURRENT_CALLS), options=options,
                         interceptors=[TokenInterceptor(token)] if token else [],
                         maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS)
    servicer = DataPlaneServicer(runner, workers)
    _add_servicer(servicer, server)
    _add_health(server)
    return server, add_port(server, listen, credentials), servicer


def create_health_server(listen: str) -> tuple[grpc.Server, int]:
    """A plaintext server of grpc.health.v1 alone (not started), for probes that cannot speak TLS
    (Kubernetes' gRPC probes); returns it and its bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[EXCLUSIVE_PORT], maximum_concurrent_rpcs=4)
    _add_health(server)
    return server, add_port(server, listen, flag="--health-listen")
