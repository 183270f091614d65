"""``twinplane bench``: a workload through the full gRPC path, with throughput, latency and roofline.

The default workload is nano-vLLM's bench.py, draw for draw: seed 0, 256 requests, prompts of
uniform length in [100, 1024] made of random token ids in [0, 10000] (its ``randint`` includes
both ends), max_tokens uniform in [100, 1024] (133,966 output tokens), temperature 0.6,
ignore_eos, on ``dummy:qwen3-0.6b`` with max_model_len 4096. Like nano-vLLM, one
``random.Random(seed)`` draws every prompt first (its length, then its ids), then every
max_tokens. ``--workload interleaved`` draws each prompt (ids in [0, 10000)) followed by its
max_tokens instead (137,723 output tokens): the workload of BENCHMARKS.md's rows before
nano-vLLM's order became the default. With ``--num-prefixes`` the prefixes are drawn after the
requests, from the same generator. Without ``--server`` it starts both planes itself
(``twinplane serve`` as a child process). With ``--request-rate`` requests arrive as a Poisson
process instead of all at once, and time to first token and inter-token latency are what matter.
Their arrival times are drawn with the workload, before the timed run, as one process over all
requests: with ``--client-processes K`` each process sends its share at those times, so the
rate is the one asked for, not K times it. With ``--masked-share F`` a share F of the requests
(drawn from a generator of their own, so the workload stays nano-vLLM's) asks for structured
output, its text to match ``--masked-regex``: by default one that every text matches, so they run
to max_tokens like the others and the run shows what the token masks cost the steps they are in.

Two rooflines are printed. The bandwidth roofline is the time the GPU would need to move this
workload's bytes at its peak memory bandwidth: the weights once per decode step (at least as
many steps as the longest output) and, for every generated token, the K/V of its whole
context. The step roofline (``roofline.py``) plans the steps a continuous-batching scheduler
would run under the server's max_num_seqs and max_num_batched_tokens, and takes for each the
longer of its bytes at ``--peak-bandwidth-gbs`` and its FLOPs at ``--peak-tflops``: prompt
steps are compute-bound, so it is the truer floor; the first stays comparable with older rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from twinplane.clients.roofline import ModelCost, StepLimits, StepRoofline, step_roofline
from twinplane.controlplane.event_loop import freeze_heap, run as run_loop  # run: uvloop, as the server's
from twinplane.controlplane.generation_config import SAMPLING_KEYS
from twinplane.controlplane.sequence import SamplingOptions
from twinplane.proto import step_path_names

H200_BANDWIDTH_GBS = 4800.0  # HBM3e, per GPU, datasheet
H200_BF16_TFLOPS = 989.0  # dense BF16 tensor cores, per GPU, datasheet
# Every request sends the built-in value of each sampling field that a model's generation config may default
# (but temperature, --temperature's): a run samples alike whatever the server's defaults are.
BUILT_IN_SAMPLING = {name: getattr(SamplingOptions(), name) for name in SAMPLING_KEYS if name != "temperature"}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None  # why its stream ended early
    at: float = 0.0  # seconds into the run when it is sent (Poisson arrivals at --request-rate)
    regex: str | None = None  # structured output (--masked-share)


def _kv_dtype(info) -> str:
    """The bench line's note on the KV cache's dtype, where it is not the model's (``--kv-cache-dtype fp8``)."""
    kv = getattr(info, "kv_cache_dtype", "")
    return f" in {kv}" if kv and kv != info.dtype else ""


def make_workload(args: argparse.Namespace) -> list[Request]:
    """The requests of --workload (see the module docstring); with --num-prefixes K, each prompt then
    starts with one of K shared prefixes, each prefix as often as the others, in random order."""
    rng = random.Random(args.seed)
    n = args.num_requests
    if args.workload == "nanovllm":  # every prompt, then every max_tokens; ids in [0, vocab_limit]
        token = partial(rng.randint, 0, args.vocab_limit)
        prompts = [[token() for _ in range(rng.randint(args.min_input, args.max_input))] for _ in range(n)]
        requests = [Request(prompt, rng.randint(args.min_output, args.max_output)) for prompt in prompts]
    else:  # "interleaved": each prompt followed by its max_tokens; ids in [0, vocab_limit)
        token = partial(rng.randrange, args.vocab_limit)
        requests = []
        for _ in range(n):
            prompt = [token() for _ in range(rng.randint(args.min_input, args.max_input))]
            requests.append(Request(prompt, rng.randint(args.min_output, args.max_output)))
    prefixes = [[token() for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    if prefixes:
        order = [i % len(prefixes) for i in range(len(requests))]
        rng.shuffle(order)
        for req, i in zip(requests, order):
            req.prompt = prefixes[i] + req.prompt
    if args.masked_share > 0:
        for req in random.Random(args.seed + 1).sample(requests, round(args.masked_share * n)):
            req.regex = args.masked_regex
    if args.request_rate != float("inf"):  # one arrival process over all requests, drawn before the timed run
        gaps = np.random.default_rng(args.seed).exponential(1.0 / args.request_rate, n)
        for req, at in zip(requests, np.cumsum(gaps).tolist()):
            req.at = at
    return requests


def roofline_seconds(requests: list[Request], weight_bytes: int, kv_bytes_per_token: int, max_num_seqs: int,
                     bandwidth_bytes: float) -> float:
    outputs = [r.max_tokens for r in requests]
    steps = max(max(outputs), -(-sum(outputs) // max_num_seqs))
    kv_read = sum(len(r.prompt) * r.max_tokens + r.max_tokens * (r.max_tokens - 1) // 2 for r in requests)
    kv_written = sum(len(r.prompt) + r.max_tokens for r in requests)
    return (steps * weight_bytes + (kv_read + kv_written) * kv_bytes_per_token) / bandwidth_bytes


def workload_step_roofline(requests: list[Request], info, args) -> StepRoofline:
    """The step-by-step roofline (roofline.py) on the server info describes. DP data planes count as one
    machine DP times as large: DP times the weights read per step, budgets, bandwidth and peak FLOP/s."""
    dp = max(info.data_parallel_size, 1)
    gpus = info.tensor_parallel_size * dp
    cap = args.max_prefill_tokens_with_decode
    limits = StepLimits((info.max_num_seqs or args.max_num_seqs) * dp,
                        (info.max_num_batched_tokens or args.max_num_batched_tokens) * dp, cap * dp if cap else None)
    cost = ModelCost(weight_bytes=info.weight_bytes * dp, kv_bytes_per_token=info.kv_bytes_per_token,
                     layer_params=info.layer_params, logits_params=info.hidden_size * info.vocab_size,
                     attention_flops_per_pair=4 * info.num_hidden_layers * info.num_attention_heads * info.head_dim)
    return step_roofline([(len(r.prompt), r.max_tokens) for r in requests], limits, cost,
                         args.peak_bandwidth_gbs * 1e9 * gpus, args.peak_tflops * 1e12 * gpus)


async def _one(client, req: Request, args, progress) -> None:
    req.sent = time.perf_counter()
    stream = client.generate(token_ids=req.prompt, max_tokens=req.max_tokens, temperature=args.temperature,
                             **BUILT_IN_SAMPLING, ignore_eos=True, regex=req.regex)
    try:
        async for chunk in stream:
            now = time.perf_counter()
            req.token_times.extend([now] * len(chunk.token_ids))
    except Exception as exc:  # noqa: BLE001 -- counted and reported: a benchmark run names every failure
        details = exc.details() if callable(getattr(exc, "details", None)) else exc  # a gRPC error's own words
        req.error = f"{type(exc).__name__}: {details}"
    progress.update(1)


CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
# --channels: each channel its own connection (not one shared by every channel to the same target),
# so the kernel can spread them over the server's frontend processes
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def _server_ready(client, target: str, server: subprocess.Popen | None, timeout: float) -> None:
    """Waits for the server to be SERVING; one this run started that exits meanwhile ends the wait at once
    (with exit code 78 when the server refused its flags)."""
    from twinplane.controlplane.ipc import child_exited

    ready = asyncio.ensure_future(client.wait_ready(timeout=timeout))
    while server is not None and not ready.done():
        await asyncio.wait({ready}, timeout=0.5)
        if server.poll() is not None and not ready.done():
            ready.cancel()
            raise child_exited(f"twinplane bench: the server it started exited with code {server.returncode} "
                               "(its error is above)", server.returncode)
    try:
        await ready
    except TimeoutError as exc:
        raise SystemExit(f"twinplane bench: {target}: {exc}") from None


async def _drive(target: str, requests: list[Request], args, chaos=None,
                 server: subprocess.Popen | None = None) -> tuple[float, dict, dict, object, list]:
    """Runs the workload; returns its time, the server's stats before and after, the model info and
    the CPU seconds of each client process. server: the one this run started, if it did."""
    from tqdm import tqdm

    from twinplane.clients.client import AsyncClient

    async with AsyncClient(target, options=CHANNEL_OPTIONS) as client:
        await _server_ready(client, target, server, args.ready_timeout)
        await _every_dataplane_connected(client, args.ready_timeout)
        info = await client.model_info()
        warm = Request([1, 2, 3], 8)
        with tqdm(disable=True) as none:
            await _one(client, warm, args, none)  # compiles kernels outside the timed run
        before = await client.stats()
        if args.client_processes > 1:
            elapsed, cpu = await _in_client_processes(target, requests, args, chaos)
        else:
            cpu_before = time.process_time()
            started = time.perf_counter()
            with tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr) as progress:
                await _send(target, client, requests, args, progress, chaos)
            elapsed = time.perf_counter() - started
            cpu = [time.process_time() - cpu_before]
        after = await client.stats()
    return elapsed, before, after, info, cpu


async def _send(target: str, client, requests: list[Request], args, progress, chaos=None) -> None:
    """Sends each request at its ``at`` over client, or over args.channels channels of their own."""
    from twinplane.clients.client import AsyncClient

    own = [AsyncClient(target, options=CHANNEL_OPTIONS + OWN_CONNECTION) for _ in range(args.channels)
           ] if args.channels > 1 else []
    clients = own or [client]
    try:
        for each in own:
            await each.wait_ready(timeout=args.ready_timeout)  # connected before the timed run
        freeze_heap("benchmark client")  # its own collections would read as gaps between tokens
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = [asyncio.create_task(chaos())] if chaos else []
        for i, req in enumerate(requests):
            delay = start + req.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(clients[i % len(clients)], req, args, progress)))
        await asyncio.gather(*tasks)
    finally:
        await asyncio.gather(*(each.close() for each in own))


async def _in_client_processes(target: str, requests: list[Request], args, chaos) -> tuple[float, list[float]]:
    """Splits the requests over args.client_processes processes (request i to process i mod K), which
    start together; returns the time until the last one is done and each one's CPU seconds."""
    spawn = multiprocessing.get_context("spawn")
    k = args.client_processes
    barrier, results = spawn.Barrier(k + 1), spawn.Queue()
    processes = [spawn.Process(target=_client_process, args=(target, requests[i::k], args, barrier, results, i))
                 for i in range(k)]
    for process in processes:
        process.start()
    chaos_task = asyncio.create_task(chaos()) if chaos else None
    await asyncio.to_thread(barrier.wait, args.ready_timeout)
    started = time.perf_counter()
    cpu = [0.0] * k
    for _ in range(k):
        index, outcomes, seconds = await asyncio.to_thread(results.get)
        cpu[index] = seconds
        for req, (sent, token_times, error) in zip(requests[index::k], outcomes):
            req.sent, req.token_times, req.error = sent, token_times, error
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join()
    if chaos_task is not None:
        await chaos_task
    return elapsed, cpu


def _client_process(target: str, requests: list[Request], args, barrier, results, index: int) -> None:
    """One client process: its share of the requests, once every process is connected."""
    from tqdm import tqdm

    from twinplane.clients.client import AsyncClient

    async def run() -> None:
        async with AsyncClient(target, options=CHANNEL_OPTIONS + OWN_CONNECTION) as client:
            await client.wait_ready(timeout=args.ready_timeout)
            await asyncio.to_thread(barrier.wait, args.ready_timeout)
            with tqdm(disable=True) as none:
                await _send(target, client, requests, args, none)

    cpu_before = time.process_time()
    run_loop(run())
    outcomes = [(r.sent, r.token_times, r.error) for r in requests]
    results.put((index, outcomes, time.process_time() - cpu_before))


async def _every_dataplane_connected(client, timeout: float) -> None:
    """Waits until every data plane of the server is connected (SERVING needs only one)."""
    deadline = time.monotonic() + timeout
    while not all(d["connected"] for d in (await client.stats())["dataplanes"]):
        if time.monotonic() > deadline:
            raise SystemExit(f"not every data plane connected within {timeout:.0f} s")
        await asyncio.sleep(0.5)


def _percentiles(figures: dict, name: str) -> str:
    if figures[f"{name}_p50_s"] is None:
        return "n/a"
    return f"p50 {figures[f'{name}_p50_s'] * 1e3:.1f} ms, p99 {figures[f'{name}_p99_s'] * 1e3:.1f} ms"


def _tpot(requests: list[Request]) -> list[float]:
    """Each request's mean time per output token after its first: tokens that arrive several in one
    message (plans of several decode steps) count at their mean pace, not as gaps of 0."""
    return [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in requests
            if len(r.token_times) > 1]


def report(requests: list[Request], elapsed: float, before: dict, after: dict, info, args,
           client_cpu: list[float] = ()) -> dict:
    output_tokens = sum(len(r.token_times) for r in requests)
    ttft = [r.token_times[0] - r.sent for r in requests if r.token_times]
    itl = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = _tpot(requests)
    dp = max(info.data_parallel_size, 1)  # data planes, each with its own GPUs, weights and batch
    bandwidth = args.peak_bandwidth_gbs * 1e9 * info.tensor_parallel_size * dp
    roofline = roofline_seconds(requests, info.weight_bytes * dp, info.kv_bytes_per_token, args.max_num_seqs * dp,
                                bandwidth)
    steps = after["steps"] - before["steps"]
    idle_us, execute_us = after["idle_us"] - before["idle_us"], after["execute_us"] - before["execute_us"]
    launch_us = after["launch_us"] - before["launch_us"]
    full = {name: after[f"full_decode_{name}"] - before[f"full_decode_{name}"]
            for name in ("steps", "idle_us", "execute_us")}
    figures = {
        "output_tokens": output_tokens, "seconds": elapsed, "tokens_per_s": output_tokens / elapsed,
        "roofline_s": roofline, "roofline_fraction": roofline / elapsed, "steps": steps,
        "idle_fraction": idle_us / max(execute_us, 1), "preemptions": after["preemptions"] - before["preemptions"],
        "launch_ms_per_step": launch_us / max(steps, 1) / 1e3,
        "full_decode_steps": full["steps"], "full_decode_idle_fraction": full["idle_us"] / max(full["execute_us"], 1),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        figures[f"{name}_p50_s"], figures[f"{name}_p99_s"] = np.percentile(values, [50, 99]) if values else (None, None)
    figures["itl_max_s"] = max(itl, default=0.0)
    structured = [r for r in requests if r.regex is not None]
    if structured:  # --masked-share: each group's pace apart
        free = [r for r in requests if r.regex is None]
        for name, group in (("structured", structured), ("free", free)):
            values = _tpot(group)
            figures[f"{name}_tpot_p50_s"], figures[f"{name}_tpot_p99_s"] = \
                np.percentile(values, [50, 99]) if values else (None, None)
    # the gaps a p99 is made of: how many exceed twice the median
    figures["itl_over_2x_p50"] = float(np.mean(np.asarray(itl) > 2 * figures["itl_p50_s"])) if itl else 0.0
    by_step = workload_step_roofline(requests, info, args)
    figures.update(step_roofline_s=by_step.seconds, step_roofline_fraction=by_step.seconds / elapsed,
                   step_roofline_steps=by_step.num_steps, compute_bound_steps=by_step.compute_bound_steps)
    failed = [r for r in requests if r.error or len(r.token_times) != r.max_tokens]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    figures["prefix_cache_hit_rate"] = (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / max(queries, 1)
    figures["incomplete_requests"] = len(failed)
    print(f"model {info.model} ({info.dtype}, TP={info.tensor_parallel_size}, DP={dp}, {info.device}, "
          f"attention {info.attention_backend}, {info.num_kv_blocks} KV blocks of {info.block_size}"
          f"{_kv_dtype(info)})")
    print(f"requests {len(requests)} ({len(failed)} incomplete), output tokens {output_tokens}, "
          f"time {elapsed:.2f} s, throughput {figures['tokens_per_s']:.0f} tok/s")
    for r in failed[:5]:
        print(f"  incomplete: {len(r.token_times)} of {r.max_tokens} tokens, {r.error or 'stream ended early'}")
    print(f"prefix cache: {100 * figures['prefix_cache_hit_rate']:.1f}% of prompt tokens found cached; per data "
          f"plane: " + ", ".join(_dataplane_share(b, a) for b, a in zip(before["dataplanes"], after["dataplanes"])))
    print(f"roofline {roofline:.2f} s at {args.peak_bandwidth_gbs:.0f} GB/s per GPU "
          f"(weights {info.weight_bytes / 1e9:.2f} GB/step, KV {info.kv_bytes_per_token} B/token): "
          f"{100 * figures['roofline_fraction']:.1f}% of roofline")
    print(f"roofline by step {by_step.seconds:.2f} s: {by_step.num_steps} planned steps, each the longer of its "
          f"bytes at {args.peak_bandwidth_gbs:.0f} GB/s and its FLOPs at {args.peak_tflops:.0f} TFLOPS per GPU "
          f"({by_step.compute_bound_steps} compute-bound): {100 * figures['step_roofline_fraction']:.1f}% of it")
    print(f"data plane: {steps} steps, {execute_us / max(steps, 1) / 1e3:.2f} ms per step, idle between steps "
          f"{100 * figures['idle_fraction']:.1f}% of step time, host launch {figures['launch_ms_per_step']:.2f} ms "
          f"per step; preemptions {figures['preemptions']}")
    print(f"full-batch decode ({args.max_num_seqs} sequences): {full['steps']} steps, "
          f"{full['execute_us'] / max(full['steps'], 1) / 1e3:.2f} ms per step, idle before them "
          f"{100 * figures['full_decode_idle_fraction']:.1f}% of step time")
    print(f"steps by path: {_paths(before, after)}")
    print(f"TTFT {_percentiles(figures, 'ttft')}; inter-token latency {_percentiles(figures, 'itl')}, max "
          f"{figures['itl_max_s'] * 1e3:.1f} ms, {100 * figures['itl_over_2x_p50']:.2f}% of gaps over 2x p50; "
          f"time per output token {_percentiles(figures, 'tpot')}")
    if structured:
        print(f"time per output token: {len(structured)} structured requests {_percentiles(figures, 'structured_tpot')}"
              f", {len(requests) - len(structured)} others {_percentiles(figures, 'free_tpot')}")
    if client_cpu:
        print(f"benchmark client: {len(client_cpu)} process(es), {args.channels} channel(s) each, CPU time "
              + " / ".join(f"{seconds:.2f}" for seconds in client_cpu) + " s")
    return figures


def _dataplane_share(before: dict, after: dict) -> str:
    tokens = after["computed_tokens"] - before["computed_tokens"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return f"{after['target']}: {tokens} tokens computed, {100 * hits / max(queries, 1):.1f}% cached"


def _paths(before: dict, after: dict) -> str:
    """Steps and their mean step time for each way the data plane ran them."""
    delta = {name: after[name] - before.get(name, 0) for name in after if name != "dataplanes"}
    named = [path for path in step_path_names().values() if f"{path}_steps" in delta]
    paths = {path: (delta[f"{path}_steps"], delta[f"{path}_execute_us"]) for path in named}
    paths["eager"] = (delta["steps"] - sum(n for n, _ in paths.values()),
                      delta["execute_us"] - sum(us for _, us in paths.values()))
    return ", ".join(f"{name.replace('_', ' ')} {n} ({us / max(n, 1) / 1e3:.2f} ms each)"
                     for name, (n, us) in paths.items())


def _reserve_port() -> socket.socket:
    """A loopback TCP port for the server's frontends, held until the server is gone: bound with
    SO_REUSEPORT and never listening, so the frontends (which bind it with SO_REUSEPORT too) can share
    it and no other program can take it while the server starts. It takes no connections: the
    kernel spreads them over listening sockets only."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _start_server(args) -> tuple[subprocess.Popen, str, socket.socket | None]:
    """The server bench runs against, its address, and the socket that holds its TCP port (several
    frontends) or None (a unix socket): close it after the server is gone."""
    from twinplane.clients.cli import _dataplane_argv

    reserved = None
    if args.api_server_count > 1:  # frontends share a TCP port (the kernel spreads connections over them)
        reserved = _reserve_port()
        address = f"127.0.0.1:{reserved.getsockname()[1]}"
    else:
        address = f"unix://{tempfile.mkdtemp(prefix='twinplane-bench-')}/api.sock"
    log_level = getattr(args, "log_level", None) or "WARNING"  # the service logs at the benchmark's level
    command = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", log_level, "serve",
               *_dataplane_argv(args), "--listen", address, "--max-waiting-requests", str(args.num_requests + 16)]
    if args.max_prefill_tokens_with_decode:
        command += ["--max-prefill-tokens-with-decode", str(args.max_prefill_tokens_with_decode)]
    if args.masked_share > 0 and args.model.startswith("dummy:"):  # masks need the tokens' text: the embedded one's
        from twinplane.dataplane.embedded import resolve_model
        command += ["--tokenizer", resolve_model("default")]
    command += ["--stream-interval", str(args.stream_interval), "--max-steps-in-flight", str(args.max_steps_in_flight),
                "--decode-steps", str(args.decode_steps), "--decode-steps-max-seqs", str(args.decode_steps_max_seqs),
                "--data-parallel-size", str(args.data_parallel_size), "--routing", args.routing,
                "--api-server-count", str(args.api_server_count)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL), address, reserved


async def _kill_a_dataplane(server: subprocess.Popen, after: float) -> None:
    """SIGKILLs the last data-plane child of the server after some seconds (its streams must still finish)."""
    await asyncio.sleep(after)
    found = subprocess.run(["pgrep", "-P", str(server.pid), "-f", "dataplane"], capture_output=True, text=True)
    pids = [int(pid) for pid in found.stdout.split()]
    if pids:
        os.kill(pids[-1], signal.SIGKILL)
        print(f"killed data plane pid {pids[-1]} after {after:.1f} s", file=sys.stderr)


def _check_workload(args: argparse.Namespace) -> None:
    """The workload's flags in range, before a server starts: SystemExit names the one that is not."""
    from twinplane.clients.client import MAX_WAIT_S
    from twinplane.controlplane.api import sampling_options
    from twinplane.controlplane.errors import InvalidRequest

    problems = [
        (args.num_requests >= 1, f"--num-requests must be >= 1, got {args.num_requests}"),
        (1 <= args.min_input <= args.max_input,
         f"--min-input and --max-input must be 1 <= min <= max, got {args.min_input} and {args.max_input}"),
        (1 <= args.min_output <= args.max_output,
         f"--min-output and --max-output must be 1 <= min <= max, got {args.min_output} and {args.max_output}"),
        (args.vocab_limit >= 1, f"--vocab-limit must be >= 1, got {args.vocab_limit}"),
        (args.request_rate > 0, f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}"),
        (0 < args.ready_timeout <= MAX_WAIT_S, f"--ready-timeout must be in (0, {MAX_WAIT_S:.0f}] seconds, "
                                               f"got {args.ready_timeout}"),
        (args.seed >= 0, f"--seed must be >= 0, got {args.seed}"),
        (0 < args.peak_bandwidth_gbs < math.inf and 0 < args.peak_tflops < math.inf,
         f"--peak-bandwidth-gbs and --peak-tflops must be > 0 and finite, got {args.peak_bandwidth_gbs} and "
         f"{args.peak_tflops}"),
        (not args.save_result or os.path.isdir(os.path.dirname(os.path.abspath(args.save_result))),
         f"--save-result {args.save_result}: its folder does not exist"),
        (args.num_prefixes >= 0 and args.prefix_len >= 0,
         f"--num-prefixes and --prefix-len must be >= 0, got {args.num_prefixes} and {args.prefix_len}"),
        (0 <= args.masked_share <= 1, f"--masked-share must be in [0, 1], got {args.masked_share}"),
    ]
    for ok, message in problems:
        if not ok:
            raise SystemExit(f"twinplane bench: {message}")
    try:  # as the server checks every request's, which would fail each one, after the model loads
        sampling_options({"temperature": args.temperature}, prefix="--")
    except InvalidRequest as exc:
        raise SystemExit(f"twinplane bench: {exc}") from None


def run_bench(args: argparse.Namespace) -> int:
    from twinplane.clients.cli import _check_server

    if args.client_processes < 1 or args.channels < 1:
        raise SystemExit("twinplane bench: --client-processes and --channels must be >= 1")
    if args.server is not None:  # "" too: not the server bench would start without one
        _check_server("bench", args.server)
    _check_workload(args)
    requests = make_workload(args)
    server, target, reserved = (None, args.server, None) if args.server else _start_server(args)
    chaos = None
    if args.kill_dataplane_after is not None and server is not None:
        chaos = lambda: _kill_a_dataplane(server, args.kill_dataplane_after)  # noqa: E731
    try:
        elapsed, before, after, info, cpu = run_loop(_drive(target, requests, args, chaos, server))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
            if reserved is None:
                shutil.rmtree(os.path.dirname(target.removeprefix("unix://")), ignore_errors=True)
            else:
                reserved.close()
    figures = report(requests, elapsed, before, after, info, args, cpu)
    if args.save_result:
        save_result(args.save_result, requests, figures, args)
    if figures["incomplete_requests"]:
        print(f"twinplane bench: {figures['incomplete_requests']} of {len(requests)} requests did not complete",
              file=sys.stderr)
        return 1
    return 0


def save_result(path: str, requests: list[Request], figures: dict, args: argparse.Namespace) -> None:
    """Writes the run as JSON: the printed figures, the flags, and each request's prompt length, max_tokens,
    send time and token arrival times in seconds from the first send (tokens that came in one message share
    a time), so gaps can be traced to what the service was doing. ``first_send_unix_s`` (the first send on
    the wall clock) lines them up with the time stamps of the service's logs (``--log-level DEBUG``: a line
    per step from each plane)."""
    t0 = min(r.sent for r in requests)
    run = {
        "first_send_unix_s": time.time() - (time.perf_counter() - t0),
        "figures": figures,
        "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))  # --request-rate inf
                 for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "requests": [{"prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens, "sent_s": r.sent - t0,
                      "token_times_s": [t - t0 for t in r.token_times], "error": r.error} for r in requests],
    }
    with open(path, "w") as f:
        json.dump(run, f)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--server", default=None,
                   help="benchmark a running server at this address (default: start twinplane serve)")
    g.add_argument("--workload", default="nanovllm", choices=["nanovllm", "interleaved"],
                   help="order of the random draws: nanovllm (its bench.py: every prompt, then every "
                        "max_tokens) or interleaved (each prompt, then its max_tokens: BENCHMARKS.md's older rows)")
    g.add_argument("--num-requests", type=int, default=256, help="requests in the workload")
    g.add_argument("--min-input", type=int, default=100, help="shortest prompt, in tokens")
    g.add_argument("--max-input", type=int, default=1024, help="longest prompt, in tokens")
    g.add_argument("--min-output", type=int, default=100, help="smallest max_tokens")
    g.add_argument("--max-output", type=int, default=1024, help="largest max_tokens")
    g.add_argument("--vocab-limit", type=int, default=10000,
                   help="prompt token ids are drawn from [0, this] (nanovllm) or [0, this) (interleaved)")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every request")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends them all at once")
    g.add_argument("--peak-bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS,
                   help="memory bandwidth per GPU in GB/s, for the roofline")
    g.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                   help="dense matrix-multiply TFLOP/s per GPU in the model's dtype, for the step roofline")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to serve")
    g.add_argument("--client-processes", type=int, default=1,
                   help="processes sending the requests (request i from process i mod this), so that the "
                        "client is not what limits a fast server")
    g.add_argument("--channels", type=int, default=1,
                   help="connections per client process, the requests spread over them (several let the kernel "
                        "spread them over a server's --api-server-count frontends)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="passed to the server it starts (more than 1: it serves on a loopback TCP port; spread the "
                        "requests with --client-processes and --channels)")
    g.add_argument("--max-prefill-tokens-with-decode", type=int, default=None,
                   help="passed to the server it starts (default: no cap)")
    g.add_argument("--save-result", metavar="PATH", default=None,
                   help="also write the figures and every token's arrival time (JSON) to PATH (default: not written)")
    g.add_argument("--stream-interval", type=int, default=1, help="passed to the server it starts")
    g.add_argument("--max-steps-in-flight", type=int, default=2, help="passed to the server it starts")
    g.add_argument("--decode-steps", type=int, default=8, help="passed to the server it starts")
    g.add_argument("--decode-steps-max-seqs", type=int, default=4, help="passed to the server it starts")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="passed to the server it starts")
    g.add_argument("--routing", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                   help="passed to the server it starts")
    g.add_argument("--num-prefixes", type=int, default=0,
                   help="shared prompt prefixes, each starting as many prompts, in random order (0: none)")
    g.add_argument("--prefix-len", type=int, default=1000, help="tokens of each shared prefix")
    g.add_argument("--masked-share", type=float, default=0.0,
                   help="share of the requests with structured output, matching --masked-regex")
    g.add_argument("--masked-regex", default=r"[\s\S]*",
                   help="what their text must match, by default a regex every text matches (default: %(default)s)")
    g.add_argument("--kill-dataplane-after", type=float, default=None,
                   help="SIGKILL one data plane of the server it starts after this many seconds (default: never)")
    p.set_defaults(model="dummy:qwen3-0.6b")
