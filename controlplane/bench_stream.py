"""The control plane's own ceiling: the bench workload against a data plane that computes nothing.

    python -m twinplane.controlplane.bench_stream [--api-server-count N] [twinplane bench options]

A stand-in data plane (in this process) answers every StepPlan at once with one token
per sampled sequence, so the figures measure only the control plane (scheduling,
plans, streaming to 256 clients over gRPC) and the benchmark client: the output
tokens per second that no GPU speed-up can push the service beyond. With
``--api-server-count N`` the control plane runs N frontend processes on a loopback TCP port;
give the benchmark client ``--client-processes`` and ``--channels`` to match, so that the
client is not what limits the figure. It prints each process's CPU time.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent import futures

import grpc
import numpy as np

from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

QWEN3_0_6B = dp.DescribeResponse(
    model="null:qwen3-0.6b", architecture="Qwen3ForCausalLM", dtype="bfloat16", block_size=256,
    num_kv_blocks=4500, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
    tensor_parallel_size=1, attention_backend="none", vocab_size=151936, eos_token_ids=[151645],
    max_logprobs=20, device="none", weight_bytes=1192099840, kv_bytes_per_token=114688, hidden_size=1024,
    num_hidden_layers=28, num_attention_heads=16, head_dim=128, layer_params=440401920)


class NullDataPlane(dp_grpc.DataPlaneServicer):
    """Samples token 1 for every sequence that samples, instantly."""

    def Describe(self, request, context):
        return QWEN3_0_6B

    def Reset(self, request, context):
        return dp.ResetResponse()

    def Step(self, request_iterator, context):
        for plan in request_iterator:
            sampled = int(np.frombuffer(plan.sample, dtype=np.uint8).sum())
            yield dp.StepResult(step_id=plan.step_id,
                                sampled_token_ids=np.ones(sampled, dtype="<i4").tobytes())


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (Linux)."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat(int(entry))[1]) == pid:
                    children.append(int(entry))
            except (OSError, IndexError):
                continue  # gone meanwhile
    return children


def serve_stand_in(servicer: dp_grpc.DataPlaneServicer) -> tuple[grpc.Server, str, str]:
    """Starts a stand-in data plane on a unix socket; returns the server, its address, and an
    address beside it for the control plane to listen on."""
    folder = tempfile.mkdtemp(prefix="twinplane-null-")
    dp_address, api = f"unix://{folder}/dp.sock", f"unix://{folder}/api.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    dp_grpc.add_DataPlaneServicer_to_server(servicer, server)
    server.add_insecure_port(dp_address)
    server.start()
    return server, dp_address, api


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _option(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def _control_plane_cpu(pid: int) -> str:
    """The CPU time of the control plane's processes: frontends (the primary first), engine core."""
    frontends, core = [f"frontend 0 {_cpu_seconds(pid):.2f} s"], []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            is_core = b"engine_core" in f.read()
        if is_core:
            core.append(f"engine core {_cpu_seconds(child):.2f} s")
        else:
            frontends.append(f"frontend {len(frontends)} {_cpu_seconds(child):.2f} s")
    return ", ".join(frontends + core)


def main() -> int:
    server, dp_address, api = serve_stand_in(NullDataPlane())
    cli = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING"]
    args = sys.argv[1:]
    interval = _option(args, "--stream-interval", "1")
    frontends = _option(args, "--api-server-count", "1")
    if "--api-server-count" in args:  # the control plane's, not the client's
        del args[args.index("--api-server-count"):args.index("--api-server-count") + 2]
    if frontends != "1":  # frontends share a TCP port; a unix socket cannot be shared
        api = f"127.0.0.1:{_free_loopback_port()}"
    control = subprocess.Popen([*cli, "controlplane", "--dataplane", dp_address, "--listen", api,
                                "--max-waiting-requests", "100000", "--stream-interval", interval,
                                "--api-server-count", frontends])
    try:
        code = subprocess.call([*cli, "bench", "--server", api, *args])
        print(f"control plane CPU time: {_control_plane_cpu(control.pid)} (user + system, start-up included)")
        return code
    finally:
        control.terminate()
        control.wait(30)
        server.stop(0)
        shutil.rmtree(os.path.dirname(dp_address.removeprefix("unix://")), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
