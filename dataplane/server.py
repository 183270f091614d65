"""The data plane's gRPC server: Describe, Step (one result per plan, in order), Reset.

The model runner is single-threaded; one Step stream is served at a time. A
plan that fails is answered with an error result for that step only, and the
process keeps serving.
"""

from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from twinplane.dataplane.convert import describe_to_pb, output_to_pb, plan_from_pb
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

log = logging.getLogger("twinplane.dataplane")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
TOKEN_HEADER = "x-twinplane-token"


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
            for msg in request_iterator:
                yield self._step(msg)

    def _step(self, msg: dp.StepPlan) -> dp.StepResult:
        try:
            if self.workers is not None:
                self.workers.step(msg.SerializeToString())
            return output_to_pb(self.runner.step(plan_from_pb(msg)))
        except Exception as exc:  # the step fails, the process keeps serving
            log.exception("step %d failed", msg.step_id)
            return dp.StepResult(step_id=msg.step_id, error=f"{type(exc).__name__}: {exc}")


def create_server(runner, listen: str, token: str | None = None, workers=None) -> tuple[grpc.Server, int]:
    """Builds the data-plane server (not started); returns it and the bound port (0 for unix sockets)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
    dp_grpc.add_DataPlaneServicer_to_server(DataPlaneServicer(runner, token, workers), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    return server, port
