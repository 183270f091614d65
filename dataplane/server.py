"""The data plane's gRPC server: Describe, Step (one result per plan, in order), Reset.

One Step stream is served at a time. Its plans are launched as soon as they arrive,
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
from collections import deque
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from twinplane.dataplane.convert import describe_to_pb, output_to_pb, plan_from_pb
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


class DataPlaneServicer(dp_grpc.DataPlaneServicer):
    def __init__(self, runner, token: str | None = None, workers=None):
        self.runner = runner
        self.token = token
        self.workers = workers  # TensorParallelWorkers, or None with one rank
        self.lock = threading.Lock()  # one Step stream, Reset or Describe at a time

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return
        sent = dict(context.invocation_metadata()).get(TOKEN_HEADER, "")
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong data-plane token")

    def Describe(self, request, context) -> dp.DescribeResponse:
        self._authorize(context)
        return describe_to_pb(self.runner.describe())

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
        self._authorize(context)
        with self.lock:
            self._reset()
        return dp.ResetResponse()

    def _reset(self) -> None:
        if self.workers is not None:
            self.workers.reset()
        self.runner.reset()

    def Step(self, request_iterator, context):
        self._authorize(context)
        with self.lock:
            self._reset()  # a new stream means a new control-plane session
            yield from _StepPipeline(self._launch).run(request_iterator)

    def _launch(self, msg: dp.StepPlan):
        """Queues a plan on the device; returns its LaunchedStep, or a StepResult if it failed."""
        try:
            if self.workers is not None:
                self.workers.step(msg.SerializeToString())
            return self.runner.launch(plan_from_pb(msg))
        except Exception as exc:  # the step fails, the process keeps serving
            return _failed(msg.step_id, exc)


def _failed(step_id: int, exc: Exception) -> dp.StepResult:
    log.error("step %d failed: %s: %s", step_id, type(exc).__name__, exc, exc_info=not isinstance(exc, ValueError))
    return dp.StepResult(step_id=step_id, error=f"{type(exc).__name__}: {exc}")


_FINISHED = object()  # the watcher saw the oldest launched step finish


class _StepPipeline:
    """Launches each plan on arrival and yields the results in order as steps finish."""

    def __init__(self, launch) -> None:
        self.launch = launch
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # plans, _FINISHED, or None (stream ended)
        self.to_watch: queue.SimpleQueue = queue.SimpleQueue()

    def run(self, requests):
        threading.Thread(target=self._read, args=(requests,), daemon=True, name="twinplane-plans").start()
        threading.Thread(target=self._watch, daemon=True, name="twinplane-watch").start()
        launched = deque()
        debug = step_log.isEnabledFor(logging.DEBUG)
        previous_finished = 0.0  # host time the watcher saw the previous step finish
        try:
            while (event := self.events.get()) is not None:
                what, at = event
                if what is _FINISHED:
                    step, times = launched.popleft()
                    if debug:
                        _log_timeline(step, times, previous_finished, at)
                    previous_finished = at
                    yield self._result(step)
                    continue
                started = time.perf_counter()
                step = self.launch(what)
                launched.append((step, (at, started, time.perf_counter())))
                self.to_watch.put(step)
            while launched:  # no more plans: the results still due, in order
                yield self._result(launched.popleft()[0])
        finally:
            self.to_watch.put(None)
            for step, _ in launched:  # the stream is gone; let queued device work end before the next one
                if not isinstance(step, dp.StepResult):
                    step.wait()

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
            for msg in requests:
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


def create_server(runner, listen: str, token: str | None = None,
                  workers=None) -> tuple[grpc.Server, int, DataPlaneServicer]:
    """Builds the data-plane server (not started); returns it, the bound port (0 for unix sockets)
    and the servicer (whose ``close`` releases the runner after the server stopped)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *KEEPALIVE_OPTIONS]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
    servicer = DataPlaneServicer(runner, token, workers)
    dp_grpc.add_DataPlaneServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    return server, port, servicer
