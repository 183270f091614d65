"""The control plane's connection to the data plane: Describe, Step stream, Reset."""

from __future__ import annotations

import asyncio

import grpc

from twinplane.controlplane.tls import DataPlaneTls, is_unix
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # plans of long prompts are large


FATAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class DataPlaneLost(Exception):
    """The data plane went away (crash, restart, network), or refused us (fatal: wrong token);
    not_up: nothing listens at its address yet (a data plane still loading its model); declined: we
    refused it (connect's refusal)."""

    def __init__(self, message: str, fatal: bool = False, not_up: bool = False, declined: bool = False):
        super().__init__(message)
        self.fatal = fatal or declined
        self.not_up = not_up
        self.declined = declined


def _nothing_listens(exc: grpc.aio.AioRpcError) -> bool:
    """The call failed because no server listens at the address (no socket file, or refused)."""
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (
        "No such file or directory" in details or "Connection refused" in details)


def channel_options(silence_timeout: float) -> list[tuple[str, int]]:
    """Message limits, and keepalive pings that close a connection silent for silence_timeout seconds
    (a hung peer or a dead network; the data plane's server accepts pings every second)."""
    half = max(1000, int(silence_timeout * 500))  # ms: ping after half of it, give up after the other half
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", half), ("grpc.keepalive_timeout_ms", half), ("grpc.http2.ping_timeout_ms", half),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def _lost(exc: grpc.aio.AioRpcError | grpc.aio.UsageError) -> DataPlaneLost:
    """The step stream failed: why, in one line (an AioRpcError's text spans several)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return DataPlaneLost(f"{exc.code().name}: {exc.details()}")
    return DataPlaneLost(str(exc))


def _why(target: str, exc: grpc.aio.AioRpcError, tls: bool) -> str:
    """The failed call as one line, with a hint when the two ends seem to disagree about TLS."""
    details = exc.details() or ""
    line = f"{target}: {exc.code().name}: {details}"
    if tls and "Hostname Verification" in details:
        return (f"{line} (its certificate does not name this host: give the name it carries with "
                "--dataplane-tls-server-name)")
    if tls and ("handshake" in details.lower() or "ssl" in details.lower()):
        return f"{line} (TLS failed: does the data plane serve TLS, with a certificate --dataplane-tls-ca verifies?)"
    if not tls and not is_unix(target) and "Socket closed" in details:
        return f"{line} (if the data plane serves TLS, give --dataplane-tls-ca)"
    return line


class DataPlaneClient:
    def __init__(self, target: str, token: str | None = None, silence_timeout: float = 30.0,
                 tls: DataPlaneTls = DataPlaneTls()):
        self.target = target
        self.options = channel_options(silence_timeout)
        self.metadata = (("x-twinplane-token", token),) if token else ()
        # TLS for TCP data planes when configured; a unix socket is guarded by its folder's permissions
        self.credentials = None if is_unix(target) else tls.credentials()
        if self.credentials is not None:
            self.options += tls.options()
        self.channel: grpc.aio.Channel | None = None
        self.stub: dp_grpc.DataPlaneStub | None = None
        self.stream = None
        self.lost = False  # the Step stream ended without close(): the data plane is gone
        self.abandoned: str | None = None  # why abandon() dropped the Step stream
        self.on_lost = lambda: None  # called once when that happens

    async def connect(self, timeout: float | None = None, refusal=lambda desc: None) -> dp.DescribeResponse:
        """Opens a channel and the Step stream. A data plane that cannot be reached fails at once, with
        the reason (connection refused, a failed TLS handshake), rather than at the timeout.
        refusal(desc): why this control plane will not drive the data plane it describes (None: it
        will); a reason ends the attempt before the data plane is reset (DataPlaneLost, declined)."""
        await self.close()
        if self.credentials is None:
            self.channel = grpc.aio.insecure_channel(self.target, options=self.options)
        else:
            self.channel = grpc.aio.secure_channel(self.target, self.credentials, options=self.options)
        self.stub = dp_grpc.DataPlaneStub(self.channel)
        try:
            desc = await self.stub.Describe(dp.DescribeRequest(), timeout=timeout, metadata=self.metadata)
            if (why := refusal(desc)) is not None:
                raise DataPlaneLost(why, declined=True)
            await self.stub.Reset(dp.ResetRequest(), timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise DataPlaneLost(_why(self.target, exc, self.credentials is not None),
                                fatal=exc.code() in FATAL_CODES, not_up=_nothing_listens(exc)) from exc
        self.stream = self.stub.Step(metadata=self.metadata)
        self.stream.add_done_callback(self._stream_done)
        self.lost, self.abandoned = False, None
        return desc

    def _stream_done(self, call) -> None:
        if call is self.stream and not self.lost:  # not one that close() cancelled
            self.lost = True
            self.on_lost()

    def abandon(self, why: str) -> None:
        """Drops the Step stream of a data plane that stopped answering: a send() or receive() that
        waits on it raises DataPlaneLost(why), and on_lost is called."""
        if self.stream is not None and not self.stream.done():
            self.abandoned = why
            self.stream.cancel()

    async def send(self, plan: dp.StepPlan) -> None:
        """Sends a plan; its result is read with receive(), so work can go on in between."""
        assert self.stream is not None, "send() before connect()"
        try:
            await self.stream.write(plan)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise _lost(exc) from exc
        except asyncio.CancelledError:
            self._raise_if_abandoned()
            raise

    async def receive(self) -> dp.StepResult:
        """The result of the oldest plan sent and not yet received."""
        assert self.stream is not None, "receive() before connect()"
        try:
            result = await self.stream.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise _lost(exc) from exc
        except asyncio.CancelledError:
            self._raise_if_abandoned()
            raise
        if result is grpc.aio.EOF:
            raise DataPlaneLost("the data plane closed the step stream")
        return result

    def _raise_if_abandoned(self) -> None:
        """abandon() cancelled the call, which gRPC reports as a CancelledError: a lost data plane,
        unless this task itself is being cancelled."""
        if self.abandoned is not None and not asyncio.current_task().cancelling():
            raise DataPlaneLost(self.abandoned) from None

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.cancel()
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
