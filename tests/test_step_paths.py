"""How each step ran on the data plane (decode graph, mixed-step graph, eager), and the idle
time before full-batch decode steps, reach the engine's counters (GetStats) and the
benchmark's report."""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from tests.reliability import stop_process
from twinplane.clients.bench import Request, _paths, report
from twinplane.clients.client import Client
from twinplane.controlplane.bench_stream import (QWEN3_0_6B, EmulatedDataPlane, EmulatedDevice, NullDataPlane,
                                                 serve_stand_in)
from twinplane.controlplane.plan_codec import decode_result
from twinplane.dataplane.convert import output_to_pb
from twinplane.dataplane.plan import ScheduledSeq, StepOutput, StepPath, StepPlan
from twinplane.proto import dataplane_pb2 as dp

DECODE_US, MIXED_US, IDLE_US = 100, 300, 7
FULL_BATCH = 2  # the stand-in's max_num_seqs


def test_step_path_crosses_the_wire():
    assert {p.name: int(p) for p in StepPath} == {
        n.removeprefix("STEP_PATH_"): v for n, v in dp.StepPath.items()}
    for path in StepPath:
        out = StepOutput(step_id=3, sampled_token_ids=np.array([7], np.int32), execute_us=42, path=path)
        wire = dp.StepResult.FromString(output_to_pb(out).SerializeToString())
        assert decode_result(wire).path == int(path)


class GraphedNullDataPlane(NullDataPlane):
    """Answers at once, reporting decode steps as decode-graph replays and the rest as mixed,
    each after IDLE_US of idle time; it runs at most FULL_BATCH sequences per step."""

    def Describe(self, request, context):
        described = dp.DescribeResponse()
        described.CopyFrom(QWEN3_0_6B)
        described.max_num_seqs = FULL_BATCH
        return described

    def Step(self, request_iterator, context):
        for plan in request_iterator:
            decode = bool(np.all(np.frombuffer(plan.num_tokens, dtype="<i4") == 1))
            sampled = int(np.frombuffer(plan.sample, dtype=np.uint8).sum())
            path, execute_us = ((dp.STEP_PATH_DECODE_GRAPH, DECODE_US) if decode
                                else (dp.STEP_PATH_MIXED_GRAPH, MIXED_US))
            yield dp.StepResult(step_id=plan.step_id, sampled_token_ids=np.ones(sampled, dtype="<i4").tobytes(),
                                timings=dp.StepTimings(execute_us=execute_us, idle_us=IDLE_US, path=path))


@pytest.fixture(scope="module")
def control_plane():
    server, dp_address, api = serve_stand_in(GraphedNullDataPlane())
    control = subprocess.Popen([sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING",
                                "controlplane", "--dataplane", dp_address, "--listen", api])
    client = Client(api)
    try:
        client.wait_ready(60)
        yield client
    finally:
        stop_process(control)
        server.stop(0)


def test_model_info_carries_the_step_limits_and_shapes_the_roofline_needs(control_plane):
    info = control_plane.model_info()
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (FULL_BATCH, QWEN3_0_6B.max_num_batched_tokens)
    assert (info.hidden_size, info.num_hidden_layers, info.num_attention_heads, info.head_dim) == (1024, 28, 16, 128)
    assert info.layer_params == QWEN3_0_6B.layer_params > 0


def test_a_data_plane_that_returns_no_prompt_logprobs_fails_only_the_requests_that_want_them(control_plane):
    """The stand-in computes no prompt log-probabilities: a request that wants them ends with a message
    saying so (not with a crash in the frontend), and the next request runs."""
    with pytest.raises(grpc.RpcError) as info:
        list(control_plane.generate(token_ids=[5] * 20, max_tokens=4, prompt_logprobs=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "this data plane does not compute the prompt's log-probabilities" in info.value.details()
    assert sum(len(c.token_ids) for c in control_plane.generate(token_ids=[5] * 20, max_tokens=4, ignore_eos=True)) == 4


def test_engine_counts_steps_by_path(control_plane):
    before = control_plane.stats()
    for prompt in ([5] * 40, [6] * 70):
        stream = control_plane.generate(token_ids=prompt, max_tokens=12, ignore_eos=True, temperature=0)
        assert sum(len(chunk.token_ids) for chunk in stream) == 12
    after = control_plane.stats()
    delta = {name: after[name] - before[name] for name in after if name.endswith(("steps", "_us"))}
    decode, mixed = delta["decode_graph_steps"], delta["mixed_graph_steps"]
    # each request came after the server ran out of work: the data plane's wait before its first
    # step is a wait for requests, not for the control plane, and is not counted as idle
    assert delta["idle_us"] == IDLE_US * (delta["steps"] - 2)
    assert decode >= 2 * 10 and mixed >= 2  # one prefill step per request, then its decodes
    assert decode + mixed == delta["steps"]  # nothing ran eagerly
    assert delta["decode_graph_execute_us"] == DECODE_US * decode
    assert delta["mixed_graph_execute_us"] == MIXED_US * mixed
    assert delta["execute_us"] == DECODE_US * decode + MIXED_US * mixed
    report = _paths(before, after)
    assert report == (f"decode graph {decode} (0.10 ms each), mixed graph {mixed} (0.30 ms each), "
                      f"multi decode 0 (0.00 ms each), eager 0 (0.00 ms each)")


def test_full_batch_decode_steps_are_counted_with_their_idle_time(control_plane, capsys):
    def generate(prompt: list[int]) -> int:
        stream = control_plane.generate(token_ids=prompt, max_tokens=300, ignore_eos=True, temperature=0)
        return sum(len(chunk.token_ids) for chunk in stream)

    before = control_plane.stats()
    with ThreadPoolExecutor(2) as pool:  # two streams at once fill the stand-in's batch of two
        assert list(pool.map(generate, ([5] * 40, [6] * 70))) == [300, 300]
    after = control_plane.stats()
    delta = {name: after[name] - before[name] for name in after if name.startswith(("full_decode", "decode_graph"))}
    full = delta["full_decode_steps"]
    assert 0 < full <= delta["decode_graph_steps"] and full >= 300 - 2 * 60  # the streams overlap for most steps
    assert delta["full_decode_execute_us"] == DECODE_US * full and delta["full_decode_idle_us"] == IDLE_US * full

    requests = [Request([1] * 40, 300, 0.0, [0.1] * 300), Request([1] * 70, 300, 0.0, [0.2] * 300)]
    info = _model_info()
    args = _bench_args()
    figures = report(requests, 1.0, before, after, info, args)
    assert figures["full_decode_steps"] == full and abs(figures["full_decode_idle_fraction"] - 0.07) < 1e-9
    assert figures["step_roofline_steps"] == 1 + 299 and figures["compute_bound_steps"] == 0  # prompts, decodes
    assert figures["roofline_s"] > 0 and figures["step_roofline_fraction"] == figures["step_roofline_s"] > 0
    out = capsys.readouterr().out
    assert f"full-batch decode (2 sequences): {full} steps, 0.10 ms per step, idle before them 7.0% of step time" in out
    assert "roofline 0.00 s at 4800 GB/s per GPU" in out and "roofline by step 0.00 s: 300 planned steps" in out


def _model_info() -> SimpleNamespace:
    return SimpleNamespace(model="m", dtype="bfloat16", tensor_parallel_size=1, device="d", attention_backend="a",
                           num_kv_blocks=1, block_size=16, weight_bytes=1, kv_bytes_per_token=1, data_parallel_size=1,
                           max_num_seqs=FULL_BATCH, max_num_batched_tokens=128, layer_params=1, hidden_size=1,
                           vocab_size=1, num_hidden_layers=1, num_attention_heads=1, head_dim=1)


def _bench_args() -> SimpleNamespace:
    return SimpleNamespace(peak_bandwidth_gbs=4800.0, peak_tflops=989.0, max_num_seqs=FULL_BATCH,
                           max_prefill_tokens_with_decode=None)


def test_bench_reports_each_requests_pace_beside_the_gaps_between_tokens(control_plane, capsys):
    """Tokens that arrive two in a message (plans of several decode steps) leave gaps of 0 between
    them; time per output token still shows each request's pace, and the longest gap shows a stall."""
    stats = control_plane.stats()
    steady = Request([1] * 40, 4, 0.0, [0.010, 0.012, 0.014, 0.016])  # a token every 2 ms
    paired = Request([1] * 70, 5, 0.0, [0.020, 0.020, 0.026, 0.026, 0.032])  # two every 6 ms
    figures = report([steady, paired], 1.0, stats, stats, _model_info(), _bench_args())
    assert figures["ttft_p50_s"] == pytest.approx(0.015)
    assert figures["tpot_p50_s"] == pytest.approx((0.002 + 0.003) / 2)  # (0.032 - 0.020) / 4 = 3 ms
    assert figures["itl_p50_s"] == pytest.approx(0.002) and figures["itl_max_s"] == pytest.approx(0.006)
    assert figures["itl_over_2x_p50"] == pytest.approx(2 / 7)  # gaps 2, 2, 2 and 0, 6, 0, 6 ms: two over 4 ms
    out = capsys.readouterr().out
    assert ("inter-token latency p50 2.0 ms, p99 6.0 ms, max 6.0 ms, 28.57% of gaps over 2x p50; "
            "time per output token p50 2.5 ms") in out


def test_bench_saves_every_tokens_arrival_time_beside_the_figures(control_plane, tmp_path, capsys):
    """--save-result: the figures it printed, its flags, and each token's arrival from the first send,
    so the gaps behind a percentile can be found again; the first send on the wall clock too."""
    import json
    import time

    from twinplane.clients.bench import save_result

    stats = control_plane.stats()
    first = Request([1] * 40, 3, 5.0, [5.010, 5.012, 5.020])
    second = Request([1] * 70, 2, 5.5, [5.530, 5.530], error=None)
    figures = report([first, second], 1.0, stats, stats, _model_info(), _bench_args())
    args = argparse.Namespace(request_rate=float("inf"), seed=3, save_result=str(tmp_path / "run.json"), peers=[1])
    save_result(args.save_result, [first, second], figures, args)
    before = time.time() - (time.perf_counter() - 5.0)  # the wall clock when perf_counter read 5.0
    saved = json.loads((tmp_path / "run.json").read_text())
    assert abs(saved["first_send_unix_s"] - before) < 1.0
    assert saved["figures"]["itl_max_s"] == pytest.approx(0.008) and saved["figures"]["output_tokens"] == 5
    assert saved["args"] == {"request_rate": "inf", "seed": 3, "save_result": str(tmp_path / "run.json")}
    one, two = saved["requests"]
    assert (one["prompt_tokens"], one["max_tokens"], two["prompt_tokens"], two["max_tokens"]) == (40, 3, 70, 2)
    assert one["sent_s"] == 0.0 and two["sent_s"] == pytest.approx(0.5)
    assert one["token_times_s"] == pytest.approx([0.010, 0.012, 0.020])
    assert two["token_times_s"] == pytest.approx([0.530, 0.530]) and two["error"] is None


def test_bench_client_keeps_its_start_up_heap_out_of_collections_while_it_sends():
    """A full collection in the benchmark client delays every stream's next token, and would be
    measured as a gap the server did not cause: the client freezes its heap before the first send."""
    import asyncio
    import gc

    from tqdm import tqdm

    from twinplane.clients.bench import _send

    class Client:
        frozen_at_send: list[int] = []

        def generate(self, **_):
            self.frozen_at_send.append(gc.get_freeze_count())

            async def chunks():
                yield SimpleNamespace(token_ids=[7, 8])
            return chunks()

    gc.unfreeze()
    requests = [Request([1] * 4, 2, at=0.0), Request([1] * 4, 2, at=0.01)]
    try:
        with tqdm(disable=True) as progress:
            asyncio.run(_send("unused", Client(), requests, SimpleNamespace(channels=1, temperature=0.0), progress))
    finally:
        gc.unfreeze()
    assert len(Client.frozen_at_send) == 2 and min(Client.frozen_at_send) > 1000
    assert [len(r.token_times) for r in requests] == [2, 2] and all(r.error is None for r in requests)


def test_data_plane_logs_each_steps_host_timeline_at_debug(caplog):
    """DEBUG on ``twinplane.dataplane.steps``: one line per step, with where its host time went."""
    import re
    import time

    from twinplane.dataplane.server import _StepPipeline

    class Launched:
        def __init__(self, step_id: int) -> None:
            self.step_id, self.prepare_us, self.forward_us, self.sample_us = step_id, 7, 8, 9

        def wait(self) -> None:
            time.sleep(0.01)

        def result(self) -> StepOutput:
            return StepOutput(step_id=self.step_id, sampled_token_ids=np.array([1], np.int32))

    def plans():
        yield from (dp.StepPlan(step_id=i) for i in range(3))
        time.sleep(1.0)  # the stream stays open until every step (10 ms each) has finished

    with caplog.at_level("DEBUG", logger="twinplane.dataplane.steps"):
        results = list(_StepPipeline(lambda msg: Launched(msg.step_id)).run(plans()))
    assert [r.step_id for r in results] == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records if r.name == "twinplane.dataplane.steps"]
    pattern = (r"step (\d): plan waited \d+ us, launch \d+ us \(prepare 7 us, forward 8 us, sample 9 us\), "
               r"launched -?\d+ us before the previous step finished, ran (\d+) us after it")
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches) and [int(m.group(1)) for m in matches] == [0, 1, 2], lines
    assert all(int(m.group(2)) >= 9000 for m in matches[1:]), lines  # each step waits 10 ms after the one before


def test_the_pipeline_holds_plans_while_a_plan_waits_for_its_masks():
    """A plan whose token masks follow is watched once they have come; a plan that comes before them waits
    (launching it would feed it tokens not yet sampled); masks for a plan that failed at launch, or for a step
    that does not wait for them, are dropped.
    The results still come in plan order."""
    import time

    from twinplane.dataplane.server import _StepPipeline

    calls, state = [], {"awaiting": None}

    class Launched:
        prepare_us = forward_us = sample_us = 0

        def __init__(self, step_id: int) -> None:
            self.step_id = step_id

        def wait(self) -> None:
            pass

        def result(self) -> StepOutput:
            return StepOutput(step_id=self.step_id, sampled_token_ids=np.array([self.step_id], np.int32))

    def launch(msg):
        calls.append(("masks" if msg.masks_only else "plan", msg.step_id))
        if msg.masks_only:
            step, state["awaiting"] = state["awaiting"], None
            return step
        if msg.step_id == 3:  # fails at launch
            return dp.StepResult(step_id=3, error="a bad plan")
        step = Launched(msg.step_id)
        if msg.masks_follow:
            state["awaiting"] = step
        return step

    def messages():
        yield dp.StepPlan(step_id=1, masks_follow=True)
        yield dp.StepPlan(step_id=2)  # comes before the masks of 1: held
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # plan 2, launched too early, would show by now
        assert calls == [("plan", 1)]
        yield dp.StepPlan(step_id=9, masks_only=True)  # for no step that waits: dropped, 1 still waits
        yield dp.StepPlan(step_id=1, masks_only=True)
        yield dp.StepPlan(step_id=3, masks_follow=True)
        yield dp.StepPlan(step_id=3, masks_only=True)
        yield dp.StepPlan(step_id=4)
        time.sleep(0.1)

    results = list(_StepPipeline(launch, lambda: state["awaiting"] is not None).run(messages()))
    assert calls == [("plan", 1), ("masks", 1), ("plan", 2), ("plan", 3), ("plan", 4)]
    assert [(r.step_id, r.error) for r in results] == [(1, ""), (2, ""), (3, "a bad plan"), (4, "")]


def _decode_plan(step_id: int, num_steps: int = 1, budgets: tuple[int, ...] = (1, 1)) -> StepPlan:
    seqs = [ScheduledSeq(seq_id, np.array([5], np.int32), 10, np.array([seq_id * 16 + 10], np.int32),
                         np.empty(0, np.int32), sample=seq_id == 0 or num_steps > 1, decode_budget=budget)
            for seq_id, budget in enumerate(budgets)]
    return StepPlan(step_id, seqs, num_steps=num_steps)


def test_emulated_device_queues_steps_behind_each_other_and_counts_its_idle_time():
    import time

    device = EmulatedDevice(step_ms=500)
    first, second = device.launch(_decode_plan(1)), device.launch(_decode_plan(2))
    assert abs(second.end - first.end - 0.5) < 1e-6 and second.output.idle_us == 0  # queued: no wait
    assert second.output.execute_us == 500_000 and list(second.output.sampled_token_ids) == [1]  # one row samples
    several = device.launch(_decode_plan(3, num_steps=4, budgets=(4, 2)))
    assert several.output.execute_us == 2_000_000 and len(several.output.sampled_token_ids) == 6
    assert (several.output.path, second.output.path) == (StepPath.MULTI_DECODE, StepPath.EAGER)
    device.reset()
    quick = EmulatedDevice(step_ms=1)
    done = quick.launch(_decode_plan(1))
    assert done.result().step_id == 1 and time.perf_counter() >= done.end
    time.sleep(0.05)
    assert quick.launch(_decode_plan(2)).output.idle_us >= 45_000  # launched long after the device went idle


def test_emulated_device_time_follows_prompt_tokens_and_the_context_read():
    device = EmulatedDevice(step_ms=1, prompt_token_us=2, context_us_per_1k=30)
    none = np.empty(0, np.int32)
    # sequence 0 decodes at position 10 (context 11); sequence 1 computes a prompt chunk of 4 tokens (context 4)
    mixed = StepPlan(1, [ScheduledSeq(0, np.array([5], np.int32), 10, np.array([10], np.int32), none, sample=True),
                         ScheduledSeq(1, np.full(4, 5, np.int32), 0, np.arange(16, 20, dtype=np.int32), none,
                                      sample=True)])
    assert device.device_seconds(mixed) == pytest.approx(1e-3 + 4 * 2e-6 + (11 + 4) * 30e-9)
    # two decode steps at context 11: sequence 0 grows to 12 in the second, sequence 1 (budget 1) stays
    several = _decode_plan(2, num_steps=2, budgets=(2, 1))
    assert device.device_seconds(several) == pytest.approx(2e-3 + (11 + 11 + 12 + 11) * 30e-9)
    assert device.launch(several).output.execute_us == round(device.device_seconds(several) * 1e6)
    assert EmulatedDevice(step_ms=1).device_seconds(mixed) == pytest.approx(1e-3)  # the plain model: a fixed time


def test_emulated_launch_takes_host_time_before_the_device_work_is_queued():
    import time

    device = EmulatedDevice(step_ms=1, launch_ms=20)
    started = time.perf_counter()
    first, second = device.launch(_decode_plan(1)), device.launch(_decode_plan(2))
    assert time.perf_counter() - started >= 0.04 and first.prepare_us >= 20_000
    # the first step ended 1 ms after its launch; the device then waited for the second launch
    assert second.output.idle_us >= 19_000 and second.end - first.end >= 0.02


def test_emulated_device_behind_the_real_data_plane_server_serves_a_control_plane():
    """The stand-in of ``bench_stream --device-step-ms``: the data plane's own Step pipeline over
    the emulated device; every token arrives and the engine counts the device time."""
    server, dp_address, api = serve_stand_in(EmulatedDataPlane(step_ms=2.0))
    control = subprocess.Popen([sys.executable, "-m", "twinplane.clients.cli", "--log-level", "WARNING",
                                "controlplane", "--dataplane", dp_address, "--listen", api])
    client = Client(api)
    try:
        client.wait_ready(60)
        before = client.stats()
        with ThreadPoolExecutor(3) as pool:
            counts = pool.map(lambda n: sum(len(c.token_ids) for c in client.generate(
                token_ids=[7] * n, max_tokens=20, ignore_eos=True, temperature=0)), (10, 30, 50))
            assert list(counts) == [20, 20, 20]
        after = client.stats()
        execute_us = after["execute_us"] - before["execute_us"]
        assert after["multi_decode_steps"] > before["multi_decode_steps"]  # it takes plans of several steps
        assert execute_us % 2_000 == 0 and execute_us >= 2_000 * 20  # 2 ms a device step, 20 steps at least
    finally:
        stop_process(control)
        server.stop(0)


def test_bench_stream_help_names_its_own_options_and_starts_nothing():
    result = subprocess.run([sys.executable, "-m", "twinplane.controlplane.bench_stream", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    for option in ("--device-step-ms", "--launch-ms", "--prompt-token-us", "--context-us-per-1k", "twinplane bench"):
        assert option in result.stdout, option
