"""The control plane's own ceiling: the bench workload against a data plane that computes nothing.

    python -m twinplane.controlplane.bench_stream [--api-server-count N] [--device-step-ms MS [--launch-ms MS]
                                                  [--prompt-token-us US] [--context-us-per-1k US]]
                                                  [--max-steps-in-flight N] [--decode-steps K]
                                                  [--decode-steps-max-seqs N] [--log-level LEVEL]
                                                  [twinplane bench options]

A stand-in data plane (in this process) answers every StepPlan at once with one token
per sampled sequence, so the figures measure only the control plane (scheduling,
plans, streaming to 256 clients over gRPC) and the benchmark client: the output
tokens per second that no GPU speed-up can push the service beyond. With
``--api-server-count N`` the control plane runs N frontend processes on a loopback TCP port;
give the benchmark client ``--client-processes`` and ``--channels`` to match, so that the
client is not what limits the figure. It prints each process's CPU time. The step-pipeline
options (``CONTROL_PLANE_OPTIONS``) go to the control plane it starts, ``--log-level`` (WARNING
by default) to the control plane and the client both.

With ``--device-step-ms MS`` the stand-in is the real data-plane server (its Step pipeline,
threads and gRPC stream) over an emulated device instead: each step takes MS of device time
(each step of a plan of several, MS each), queued behind the step before it as on a GPU.
The idle time the benchmark then reports is what a device that fast would wait for the
hosts, so pacing by the host shows up without a GPU. ``--launch-ms MS`` makes each launch take
MS of host time first, holding the GIL as a real launch's Python and torch calls do (a GPU
host's data plane spent ~1.7 ms launching a small decode step). A step's device time can follow
what it computes, so that scheduling choices show in the figures as on a GPU: ``--prompt-token-us``
for each token of a prompt chunk (a sequence with more than one token in the step) and
``--context-us-per-1k`` for every 1,000 tokens of context the step's sequences read. Qwen3-0.6B
on an H200 is about ``--device-step-ms 1.0 --prompt-token-us 2 --context-us-per-1k 28`` (the KV of
1,000 tokens is 115 MB, read at ~4.1 TB/s; a prompt step of 8,192 tokens takes ~18 ms).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import numpy as np

from twinplane.dataplane.plan import MAX_DECODE_STEPS, StepOutput, StepPath, StepPlan
from twinplane.dataplane.server import DataPlaneServicer
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


class _EmulatedStep:
    """A launched step of the emulated device: its tokens are ready at ``end`` (perf_counter)."""

    forward_us = sample_us = 0  # a real launch's parts; the emulated host work counts as prepare

    def __init__(self, output: StepOutput, end: float, prepare_us: int) -> None:
        self.step_id, self.output, self.end, self.prepare_us = output.step_id, output, end, prepare_us

    def wait(self) -> None:
        time.sleep(max(0.0, self.end - time.perf_counter()))

    def result(self) -> StepOutput:
        self.wait()
        return self.output


class EmulatedDevice:
    """A runner for the data-plane server that computes nothing but keeps a device queue: a plan
    of K steps takes K * ``step_ms`` of device time, plus ``prompt_token_us`` for each token of its
    prompt chunks and ``context_us_per_1k`` for each 1,000 tokens of context its steps read, from
    when it is launched or when the step before it ends, whichever is later; the time in between
    is its idle time. Each launch first spends ``launch_ms`` of host time in Python (the GIL held).
    Token 1 for every sampled token."""

    awaits_masks = False  # it takes no plan whose masks follow (its Describe leaves masks_follow off)

    def __init__(self, step_ms: float, launch_ms: float = 0.0, prompt_token_us: float = 0.0,
                 context_us_per_1k: float = 0.0) -> None:
        self.step_s, self.launch_s = step_ms / 1e3, launch_ms / 1e3
        self.prompt_token_s, self.context_token_s = prompt_token_us / 1e6, context_us_per_1k / 1e9
        self.free_at: float | None = None  # when the last launched step ends

    def device_seconds(self, plan: StepPlan) -> float:
        """The plan's device time: each sequence's context in step k of K is its start_pos +
        num_tokens, grown by one token a step while its decode budget lasts."""
        cols = plan.cols()
        prompt = int(cols.num_tokens[cols.num_tokens > 1].sum())
        context = int((cols.start_pos.astype(np.int64) + cols.num_tokens).sum()) * plan.num_steps
        if plan.num_steps > 1:
            context += int(np.minimum(np.arange(plan.num_steps)[:, None], cols.decode_budget[None, :] - 1).sum())
        return self.step_s * plan.num_steps + self.prompt_token_s * prompt + self.context_token_s * context

    def launch(self, plan: StepPlan) -> _EmulatedStep:
        started = time.perf_counter()
        while time.perf_counter() - started < self.launch_s:
            pass  # the host's share of a launch: its device work is queued at the end
        cols = plan.cols()
        now = time.perf_counter()
        launch_us = round((now - started) * 1e6)
        begin = now if self.free_at is None else max(now, self.free_at)
        idle = 0.0 if self.free_at is None else begin - self.free_at
        busy = self.device_seconds(plan)
        self.free_at = end = begin + busy
        tokens = int(cols.decode_budget.sum()) if plan.num_steps > 1 else int(cols.sample.sum())
        path = StepPath.MULTI_DECODE if plan.num_steps > 1 else StepPath.EAGER
        return _EmulatedStep(StepOutput(step_id=plan.step_id, sampled_token_ids=np.ones(tokens, np.int32),
                                        idle_us=round(idle * 1e6), execute_us=round(busy * 1e6), path=path,
                                        launch_us=launch_us), end, launch_us)

    def reset(self) -> None:
        self.free_at = None

    def close(self) -> None:
        pass


class EmulatedDataPlane(DataPlaneServicer):
    """The data-plane server over an ``EmulatedDevice``, describing itself as Qwen3-0.6B."""

    def __init__(self, step_ms: float, launch_ms: float = 0.0, prompt_token_us: float = 0.0,
                 context_us_per_1k: float = 0.0) -> None:
        super().__init__(EmulatedDevice(step_ms, launch_ms, prompt_token_us, context_us_per_1k))

    def Describe(self, request, context):
        described = dp.DescribeResponse()
        described.CopyFrom(QWEN3_0_6B)
        described.max_decode_steps = MAX_DECODE_STEPS  # it takes plans of several decode steps, as a GPU does
        return described


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
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
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


def _take(args: list[str], name: str, default: str) -> str:
    """The value of option ``name`` (or ``default``), removed from args: it is not the client's."""
    value = _option(args, name, default)
    if name in args:
        del args[args.index(name):args.index(name) + 2]
    return value


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


# Control-plane options this tool passes on to the control plane it starts (not to the client).
CONTROL_PLANE_OPTIONS = ("--max-steps-in-flight", "--decode-steps", "--decode-steps-max-seqs")
# ... and those it passes on to both (the client's step roofline reads the prompt cap too).
SHARED_OPTIONS = ("--max-prefill-tokens-with-decode",)
DEVICE_OPTIONS = ("--launch-ms", "--prompt-token-us", "--context-us-per-1k")


def main() -> int:
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:  # this tool's own options; the rest are the benchmark client's
        print(__doc__.strip() + "\n\ntwinplane bench options: see `twinplane bench --help`.")
        return 0
    step_ms = float(_take(args, "--device-step-ms", "0"))
    device = [float(_take(args, name, "0")) for name in DEVICE_OPTIONS]
    if any(device) and not step_ms:
        sys.exit(f"{', '.join(DEVICE_OPTIONS)} need --device-step-ms")
    stand_in = EmulatedDataPlane(step_ms, *device) if step_ms > 0 else NullDataPlane()
    server, dp_address, api = serve_stand_in(stand_in)
    cli = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", _take(args, "--log-level", "WARNING")]
    interval = _option(args, "--stream-interval", "1")
    frontends = _take(args, "--api-server-count", "1")
    passed = [item for name in CONTROL_PLANE_OPTIONS if name in args for item in (name, _take(args, name, ""))]
    passed += [item for name in SHARED_OPTIONS if name in args for item in (name, _option(args, name, ""))]
    if frontends != "1":  # frontends share a TCP port; a unix socket cannot be shared
        api = f"127.0.0.1:{_free_loopback_port()}"
    control = subprocess.Popen([*cli, "controlplane", "--dataplane", dp_address, "--listen", api,
                                "--max-waiting-requests", "100000", "--stream-interval", interval,
                                "--api-server-count", frontends, *passed])
    try:
        stand_in_cpu = time.process_time()
        code = subprocess.call([*cli, "bench", "--server", api, *args])
        print(f"control plane CPU time: {_control_plane_cpu(control.pid)} (user + system, start-up included); "
              f"stand-in data plane {time.process_time() - stand_in_cpu:.2f} s")
        return code
    finally:
        control.terminate()
        control.wait(30)
        server.stop(0)
        shutil.rmtree(os.path.dirname(dp_address.removeprefix("unix://")), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
