"""Graceful shutdown: SIGTERM on either plane, as an orchestrator sends it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest

from tests.reliability import DRAIN_LONG, DRAIN_MODEL, DRAIN_SHORT, GREEDY, all_blocks_free, tokens_async, wait_until
from twinplane.clients.client import AsyncClient, Client

CLI = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING"]
GRACE = 6.0


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(10)


async def _read_until_it_ends(stream) -> tuple:
    """Reads a stream as a live client does (so flow control never holds back its final status)
    until it ends with an error: (code, details, monotonic time of the end)."""
    try:
        async for _ in stream:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), time.monotonic()
    return grpc.StatusCode.OK, "", time.monotonic()


async def _sigterm_with_streams_in_flight(address: str, sigterm: Callable[[], None]) -> dict:
    report = {}
    async with AsyncClient(address) as client:
        short = client.generate(token_ids=[11] * 20, max_tokens=DRAIN_SHORT, **GREEDY).__aiter__()
        long = client.generate(token_ids=[12] * 20, max_tokens=DRAIN_LONG, **GREEDY).__aiter__()
        firsts = [await short.__anext__(), await long.__anext__()]
        long_ends = asyncio.create_task(_read_until_it_ends(long))
        sigterm()
        started = time.monotonic()
        while await client.health_status(timeout=5) == "SERVING" and time.monotonic() - started < 20:
            await asyncio.sleep(0.05)  # until it has taken the signal
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokens_async(client, [13] * 5, max_tokens=3, timeout=10, **GREEDY)
        report["new_request"] = refused.value.code()
        report["short"] = firsts[0].token_ids + [t async for c in short for t in c.token_ids]
        code, details, ended = await long_ends
        report["long"] = (code, details, ended - started)
    return report


def _assert_drained(report: dict) -> None:
    assert report["new_request"] == grpc.StatusCode.UNAVAILABLE  # stops accepting at once
    assert len(report["short"]) == DRAIN_SHORT  # in-flight streams may finish within the grace period
    code, details, waited = report["long"]
    assert code == grpc.StatusCode.UNAVAILABLE and "shut down" in details
    assert GRACE - 0.5 < waited < GRACE + 5  # ended when the grace period ran out, not at once


def test_sigterm_on_the_control_plane_drains_then_ends_the_rest(tmp_path):
    dp_address, cp_address = f"unix://{tmp_path}/dp.sock", f"unix://{tmp_path}/cp.sock"
    dataplane = _start("dataplane", *DRAIN_MODEL, "--listen", dp_address)
    control = _start("controlplane", "--dataplane", dp_address, "--listen", cp_address,
                     "--shutdown-grace", str(GRACE))
    try:
        with Client(cp_address) as client:
            client.wait_ready(timeout=120)
        _assert_drained(asyncio.run(_sigterm_with_streams_in_flight(cp_address, lambda: control.send_signal(
            signal.SIGTERM))))
        assert control.wait(GRACE + 10) == 0
        dataplane.send_signal(signal.SIGTERM)
        assert dataplane.wait(30) == 0
    finally:
        _stop(control)
        _stop(dataplane)


def test_sigterm_before_any_data_plane_connected_ends_the_waiting_calls_at_once(tmp_path):
    """Calls that wait for a data plane that never came up end with the server's own word for it,
    not with gRPC's when it stops."""
    address = f"unix://{tmp_path}/cp.sock"
    control = _start("controlplane", "--dataplane", f"unix://{tmp_path}/nowhere.sock", "--listen", address,
                     "--shutdown-grace", str(GRACE))

    async def run() -> tuple:
        async with AsyncClient(address) as client:
            wait_until(lambda: os.path.exists(f"{tmp_path}/cp.sock"), 60, "the control plane to listen")
            assert await client.health_check(timeout=10) == "NOT_SERVING"
            waiting = asyncio.create_task(_read_until_it_ends(client.generate(token_ids=[5] * 4, max_tokens=2)))
            await asyncio.sleep(1.0)  # it waits for a data plane
            control.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(waiting, 30)

    try:
        code, details, _ = asyncio.run(run())
        assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        assert control.wait(30) == 0
    finally:
        _stop(control)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_to_the_process_group_of_serve_drains_as_sigterm_to_serve_alone(tmp_path, sig):
    """systemd stopping a service (it signals every process of it), `kill 0`, or a terminal (SIGHUP when it
    closes): serve's engine core and data plane ignore the signal, serve drains its streams with them,
    then stops them."""
    address = f"unix://{tmp_path}/cp.sock"
    serve = subprocess.Popen([*CLI, "serve", *DRAIN_MODEL, "--listen", address, "--shutdown-grace", str(GRACE)],
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        with Client(address) as client:
            client.wait_ready(timeout=120)
        _assert_drained(asyncio.run(_sigterm_with_streams_in_flight(address, lambda: os.killpg(serve.pid, sig))))
        _, stderr = serve.communicate(timeout=GRACE + 20)
        assert serve.returncode == 0, stderr.decode()
        # no child stopped by the signal: neither restarted nor missed
        assert b"exited" not in stderr and b"restarting" not in stderr, stderr.decode()
    finally:
        try:
            os.killpg(serve.pid, signal.SIGKILL)
        except ProcessLookupError:  # every process of the group has exited
            pass
        serve.wait(10)


def test_sigterm_on_the_data_plane_exits_cleanly_and_nothing_is_lost(tiny_qwen3_dir, planes_factory):
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-model-len", "512")
    with planes.client() as client:
        expected = [t for c in client.generate(token_ids=[21] * 30, max_tokens=300, **GREEDY) for t in c.token_ids]
        stream = iter(client.generate(token_ids=[21] * 30, max_tokens=300, **GREEDY))
        got = list(next(stream).token_ids)
        planes.dataplane.send_signal(signal.SIGTERM)
        assert planes.dataplane.wait(30) == 0  # clean exit, even with a Step stream open
        wait_until(lambda: not planes.engine.ready.is_set(), 10, "the control plane to notice")
        planes.start_dataplane()  # the stream waited for it
        got += [t for c in stream for t in c.token_ids]
    assert got == expected
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block to be free")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_data_plane_still_loading_ends_quietly_on_ctrl_c_or_a_closed_terminal(sig):
    """Before it serves, a data plane has nothing to finish: Ctrl-C or SIGHUP ends it at once, with code 0
    and no KeyboardInterrupt traceback through whatever it was importing."""
    script = ("import os, signal, time\n"
              "from twinplane.dataplane.stopping import Stop\n"
              "Stop()\n"
              f"os.kill(os.getpid(), {int(sig)})\n"
              "time.sleep(10)\n"
              "print('still running')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout and not result.stderr, (result.returncode, result.stderr)
