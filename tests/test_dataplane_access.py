"""Who may use a data plane: the token, one Step stream at a time (the newest wins), bounded calls,
and the tokens `twinplane serve` and `twinplane dataplane` give or require."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Planes
from tests.reliability import GREEDY, wait_until
from twinplane.clients.client import Client
from twinplane.dataplane.server import MAX_CONCURRENT_CALLS, SUPERSEDED, create_server
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

CLI = [sys.executable, "-m", "twinplane.clients.cli"]
TOKEN = "t0ken-for-access-tests"
SMALL = ("--block-size", "16", "--max-model-len", "512")
TOKEN_ENV = "TWINPLANE_DATAPLANE_TOKEN"


def _wait_serving(address: str, timeout: float = 120.0) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        wait_until(serving, timeout, f"{address} to serve", poll=0.2)


class StaleStream:
    """A Step stream that sends one empty plan, gets its answer (so it holds the data plane), then idles."""

    def __init__(self, channel: grpc.Channel, metadata=()):
        self.plans: queue.SimpleQueue = queue.SimpleQueue()
        self.plans.put(dp.StepPlan(step_id=1))
        self.call = dp_grpc.DataPlaneStub(channel).Step(iter(self.plans.get, None), metadata=metadata)
        assert next(self.call).step_id == 1

    def outcome(self, timeout: float) -> grpc.RpcError:
        """The error the stream ends with (it must end within timeout seconds)."""
        deadline = time.monotonic() + timeout
        while self.call.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.call.running(), "the stale Step stream was never ended"
        with pytest.raises(grpc.RpcError) as info:
            next(self.call)
        self.plans.put(None)
        return info.value


def test_a_newer_step_stream_takes_over_from_a_stale_one(tiny_qwen3_dir, tmp_path):
    """Clients that hold Step streams open, one after another, end up holding one thread and no lock:
    each newer stream ends the older one, and a (re)started control plane takes over from the last."""
    planes = Planes(tmp_path, tiny_qwen3_dir, SMALL)
    try:
        planes.start_dataplane()
        _wait_serving(planes.dp_address)
        with grpc.insecure_channel(planes.dp_address) as channel:
            stale = [StaleStream(channel) for _ in range(2 * MAX_CONCURRENT_CALLS)]  # each answered: it took over
            started = time.monotonic()
            planes.start_controlplane()
            planes.wait_ready(60)  # before the takeover: waits for ever behind the stale stream
            ready_after = time.monotonic() - started
            errors = [stream.outcome(30) for stream in stale]
        assert {(e.code(), e.details()) for e in errors} == {(grpc.StatusCode.ABORTED, SUPERSEDED)}
        with planes.client() as client:
            assert len(client.generate_text(token_ids=[5, 6, 7], max_tokens=4, **GREEDY)) > 0
        print(f"control plane SERVING {ready_after:.2f} s after it started, behind a stale Step stream")
    finally:
        planes.stop()


def test_calls_without_the_token_are_refused_before_they_take_the_device(tiny_qwen3_dir, tmp_path):
    planes = Planes(tmp_path, tiny_qwen3_dir, (*SMALL, "--token", TOKEN), dataplane_token=TOKEN)
    try:
        planes.start_dataplane()
        _wait_serving(planes.dp_address)  # health Check needs no token
        with grpc.insecure_channel(planes.dp_address) as channel:
            stub = dp_grpc.DataPlaneStub(channel)
            idle: queue.SimpleQueue = queue.SimpleQueue()
            rogue = [stub.Step(iter(idle.get, None), timeout=30) for _ in range(2 * MAX_CONCURRENT_CALLS)]
            rogue += [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)]
            for call in rogue:
                with pytest.raises(grpc.RpcError) as info:
                    next(call)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for _ in rogue:
                idle.put(None)
            planes.start_controlplane()
            planes.wait_ready(60)
            with planes.client() as client:
                assert len(client.generate_text(token_ids=[5, 6, 7], max_tokens=4, **GREEDY)) > 0
    finally:
        planes.stop()


class BlockingRunner:
    """Stands in for a ModelRunner whose describe() waits until released."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def describe(self):
        self.calls += 1
        self.release.wait(60)
        raise RuntimeError("released")


def test_calls_beyond_the_limit_are_refused_at_once_and_the_token_is_checked_first(tmp_path):
    runner = BlockingRunner()
    address = f"unix://{tmp_path}/dp.sock"
    server, _, _ = create_server(runner, address, TOKEN)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            describe = dp_grpc.DataPlaneStub(channel).Describe
            with pytest.raises(grpc.RpcError) as info:
                describe(dp.DescribeRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and runner.calls == 0
            token = (("x-twinplane-token", TOKEN),)
            held = [describe.future(dp.DescribeRequest(), timeout=60, metadata=token)
                    for _ in range(MAX_CONCURRENT_CALLS)]
            wait_until(lambda: runner.calls == MAX_CONCURRENT_CALLS, 30, "every thread to be busy")
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                describe(dp.DescribeRequest(), timeout=30, metadata=token)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 10
            runner.release.set()
            for call in held:
                assert call.exception(30) is not None
    finally:
        runner.release.set()
        server.stop(0)


def _dataplane(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "dataplane", "--model", "dummy:tiny-qwen3", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_dataplane_on_tcp_needs_a_token_or_insecure():
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    result = _dataplane("--listen", "127.0.0.1:0", env=env)
    assert result.returncode == 78  # EX_CONFIG
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:0 is a TCP address, which needs a token" in lines[0], result.stderr
    assert "--insecure" in lines[0] and "Traceback" not in result.stderr


def _serve(tmp_path, model, env: dict, *extra: str) -> tuple[subprocess.Popen, str, str]:
    address, dp_address = f"unix://{tmp_path}/cp.sock", f"unix://{tmp_path}/dp.sock"
    server = subprocess.Popen([*CLI, "serve", "--model", str(model), "--device", "cpu", *SMALL, "--listen", address,
                               "--dataplane-listen", dp_address, "--shutdown-grace", "1", *extra],
                              stdin=subprocess.DEVNULL, env=env)
    return server, address, dp_address


def _describe(address: str, token: str | None) -> grpc.StatusCode:
    metadata = (("x-twinplane-token", token),) if token else ()
    with grpc.insecure_channel(address) as channel:
        try:
            dp_grpc.DataPlaneStub(channel).Describe(dp.DescribeRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("given", ["environment", "flag", "random"])
def test_serve_gives_both_planes_the_same_token(tiny_qwen3_dir, tmp_path, given):
    """$TWINPLANE_DATAPLANE_TOKEN, --dataplane-token, or else a random token: the control plane
    serves, and the data plane refuses anyone else. The token is never on a command line."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({TOKEN_ENV: TOKEN} if given == "environment" else {})
    server, address, dp_address = _serve(tmp_path, tiny_qwen3_dir, env,
                                         *(("--dataplane-token", TOKEN) if given == "flag" else ()))
    try:
        with Client(address) as client:
            client.wait_ready(timeout=120)  # before: never SERVING with the variable set
        assert _describe(dp_address, None) == grpc.StatusCode.UNAUTHENTICATED
        child = psutil.Process(server.pid).children()[0]
        token = child.environ()[TOKEN_ENV]
        assert token == TOKEN if given != "random" else len(token) >= 40
        assert _describe(dp_address, token) == grpc.StatusCode.OK
        assert token not in " ".join(child.cmdline())
        assert TOKEN_ENV not in " ".join(child.cmdline())
    finally:
        server.terminate()
        assert server.wait(60) == 0
