"""Soak: 100 concurrent clients for a few minutes against both planes as separate processes.

    pytest -m slow tests/test_reliability_soak.py -s     # TWINPLANE_SOAK_SECONDS=180 by default

Every request is valid, so every error counts. Records requests served, errors,
tokens, latency and the control plane's RSS after warm-up and at the end, and prints
them as the table RELIABILITY.md shows.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest

from tests.reliability import ProcessLog, rss_bytes, stop_process
from twinplane.clients.client import AsyncClient, Client

CLIENTS, WARMUP_S = 100, 20.0
CLI = [sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING"]
PROBE = dict(token_ids=[101, 202, 303, 404, 505] * 4, max_tokens=32, temperature=0, ignore_eos=True)


def random_request(rng: random.Random) -> dict:
    """A valid request: token ids or text, greedy or seeded sampling, sometimes stop strings."""
    kwargs = dict(max_tokens=rng.randint(1, 64), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.7:
        kwargs["token_ids"] = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 120))]
    else:
        kwargs["prompt"] = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "ü", "猫"])
                                    for _ in range(rng.randint(1, 60)))
    if rng.random() < 0.5:
        kwargs.update(temperature=0)
    else:
        kwargs.update(temperature=rng.uniform(0.1, 1.5), top_p=rng.uniform(0.5, 1), top_k=rng.choice([0, 20, 50]),
                      seed=rng.randrange(2**32))
    if rng.random() < 0.2:
        kwargs["stop"] = [rng.choice(["a", "the", "\n"])]
    return kwargs


async def client_loop(address: str, index: int, until: float, counts: Counter, latencies: list[float]) -> None:
    rng = random.Random(index)
    async with AsyncClient(address) as client:
        while time.monotonic() < until:
            kwargs = random_request(rng)
            cancel_after = rng.randint(1, 4) if rng.random() < 0.05 else None
            started = time.monotonic()
            try:
                stream = client.generate(timeout=120, **kwargs)
                seen = 0
                async for chunk in stream:
                    counts["tokens"] += len(chunk.token_ids)
                    seen += 1
                    if cancel_after is not None and seen >= cancel_after:
                        stream.cancel()
                        break
                counts["cancelled" if cancel_after is not None and seen >= cancel_after else "served"] += 1
                latencies.append(time.monotonic() - started)
            except grpc.aio.AioRpcError as error:
                counts["errors"] += 1
                counts[f"error {error.code().name}: {error.details()[:80]}"] += 1


async def soak(address: str, seconds: float, control_pid: int) -> dict:
    counts: Counter = Counter()
    latencies: list[float] = []
    start = time.monotonic()
    tasks = [asyncio.ensure_future(client_loop(address, i, start + seconds, counts, latencies))
             for i in range(CLIENTS)]
    await asyncio.sleep(min(WARMUP_S, seconds / 4))
    rss_warm = rss_bytes(control_pid)
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    latencies.sort()
    return dict(counts=counts, elapsed=elapsed, rss_warm=rss_warm, rss_end=rss_bytes(control_pid),
                p50=latencies[len(latencies) // 2], p99=latencies[int(len(latencies) * 0.99)])


def probe(address: str) -> list[int]:
    with Client(address) as client:
        return [t for c in client.generate(**PROBE) for t in c.token_ids]


@pytest.mark.slow
def test_soak_100_clients(tiny_qwen3_dir, tmp_path):
    seconds = float(os.environ.get("TWINPLANE_SOAK_SECONDS", "180"))
    dp_address = f"unix://{tmp_path}/dp.sock"
    dataplane = subprocess.Popen([*CLI, "dataplane", "--model", str(tiny_qwen3_dir), "--device", "cpu",
                                  "--block-size", "16", "--max-model-len", "1024", "--listen", dp_address])
    # on any free port, which its start-up line (INFO) names
    control = subprocess.Popen([*CLI, "controlplane", "--log-level", "INFO", "--dataplane", dp_address,
                                "--listen", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True)
    try:
        address = ProcessLog(control).listening_address()
        with Client(address) as client:
            client.wait_ready(timeout=120)
        rss_start = rss_bytes(control.pid)
        before = probe(address)
        report = asyncio.run(soak(address, seconds, control.pid))
        after = probe(address)
        c = report["counts"]
        print(f"\n| duration | {report['elapsed']:.0f} s, {CLIENTS} concurrent clients |")
        print(f"| requests served (completed) | {c['served']} ({c['served'] / report['elapsed']:.1f}/s) |")
        print(f"| requests cancelled by the client (5% on purpose) | {c['cancelled']} |")
        print(f"| errors for valid requests | {c['errors']} |")
        print(f"| tokens streamed | {c['tokens']} ({c['tokens'] / report['elapsed']:.0f}/s) |")
        print(f"| latency per request p50 / p99 | {report['p50']:.2f} s / {report['p99']:.2f} s |")
        print(f"| control-plane RSS: start / after warm-up / end | {rss_start / 2**20:.0f} / "
              f"{report['rss_warm'] / 2**20:.0f} / {report['rss_end'] / 2**20:.0f} MiB |")
        assert c["errors"] == 0, {k: v for k, v in c.items() if k.startswith("error")}
        assert c["served"] > 0
        assert after == before  # the engine's state is as clean as at the start
        assert report["rss_end"] - report["rss_warm"] < 64 * 2**20  # no leak worth the name
        control.send_signal(signal.SIGTERM)
        assert control.wait(30) == 0
    finally:
        for process in (control, dataplane):
            stop_process(process)
