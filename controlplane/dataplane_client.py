"""The control plane's connection to the data plane: Describe, Step stream, Reset."""

from __future__ import annotations

import grpc

from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # plans of long prompts are large


FATAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class DataPlaneLost(Exception):
    """The data plane went away (crash, restart, network), or refused us (fatal: wrong token)."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class DataPlaneClient:
    def __init__(self, target: str, token: str | None = None):
        self.target = target
        self.metadata = (("x-twinplane-token", token),) if token else ()
        self.channel: grpc.aio.Channel | None = None
        self.stub: dp_grpc.DataPlaneStub | None = None
        self.stream = None
        self.lost = False  # the Step stream ended without close(): the data plane is gone
        self.on_lost = lambda: None  # called once when that happens

    async def connect(self, timeout: float | None = None) -> dp.DescribeResponse:
        """Opens a channel, waits for the data plane to be ready, and opens the Step stream."""
        await self.close()
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.aio.insecure_channel(self.target, options=options)
        self.stub = dp_grpc.DataPlaneStub(self.channel)
        try:
            desc = await self.stub.Describe(dp.DescribeRequest(), timeout=timeout, wait_for_ready=True,
                                            metadata=self.metadata)
            await self.stub.Reset(dp.ResetRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise DataPlaneLost(f"{self.target}: {exc.code().name}: {exc.details()}",
                                fatal=exc.code() in FATAL_CODES) from exc
        self.stream = self.stub.Step(metadata=self.metadata)
        self.stream.add_done_callback(self._stream_done)
        self.lost = False
        return desc

    def _stream_done(self, call) -> None:
        if call is self.stream and not self.lost:  # not one that close() cancelled
            self.lost = True
            self.on_lost()

    async def send(self, plan: dp.StepPlan) -> None:
        """Sends a plan; its result is read with receive(), so work can go on in between."""
        assert self.stream is not None, "send() before connect()"
        try:
            await self.stream.write(plan)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise DataPlaneLost(str(exc)) from exc

    async def receive(self) -> dp.StepResult:
        """The result of the oldest plan sent and not yet received."""
        assert self.stream is not None, "receive() before connect()"
        try:
            result = await self.stream.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise DataPlaneLost(str(exc)) from exc
        if result is grpc.aio.EOF:
            raise DataPlaneLost("the data plane closed the step stream")
        return result

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.cancel()
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
