"""Prometheus metrics on /metrics and the per-request log line, through both planes."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_e2e_reference import random_prompts
from twinplane.clients.messages import build_request
from twinplane.proto import generation_pb2_grpc as pb_grpc

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def planes(tiny_qwen3_dir, tmp_path_factory):
    from tests.conftest import Planes

    planes = Planes(tmp_path_factory.mktemp("observability"), tiny_qwen3_dir, ("--block-size", "16"),
                    metrics_port=0).start()
    yield planes
    planes.stop()


# Prometheus 2.x's Accept header: OpenMetrics first, then the text format
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def scrape(planes, accept: str = PROMETHEUS_ACCEPT) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and labels but model_name (which every sample carries,
    the served model's name): 'name{label="value"}'."""
    url = f"http://127.0.0.1:{planes.plane.metrics_port}/metrics"
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = response.read().decode()
    samples, model = {}, planes.engine.model_name
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("twinplane:") and family.type != "unknown", family
        for s in family.samples:
            assert s.name.startswith("twinplane:") and s.labels.pop("model_name") == model != "", s
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def growth(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[f"twinplane:{name}"] - before[f"twinplane:{name}"]


def test_metrics_move_during_and_after_a_generation(planes):
    prompt = random_prompts(1, seed=31, low=40, high=40)[0]
    before = scrape(planes)
    with planes.client() as client:
        chunks = iter(client.generate(token_ids=prompt, max_tokens=400, **GREEDY))
        first = next(chunks)
        during = scrape(planes)
        rest = list(chunks)
    after = scrape(planes)
    usage = rest[-1].usage
    assert first.token_ids and usage.completion_tokens == 400

    assert during["twinplane:num_requests_running"] == 1
    assert 0 < during["twinplane:kv_cache_usage_perc"] <= 1
    assert after["twinplane:num_requests_running"] == 0 and after["twinplane:num_requests_waiting"] == 0
    assert after["twinplane:kv_cache_usage_perc"] == 0  # every block freed (cached ones are reusable)

    assert growth(before, after, "prompt_tokens_total") == usage.prompt_tokens == 40
    assert growth(before, after, "generation_tokens_total") == usage.completion_tokens
    assert growth(before, after, 'request_success_total{finished_reason="length"}') == 1
    assert growth(before, after, 'request_success_total{finished_reason="stop_token"}') == 0
    assert growth(before, after, "time_to_first_token_seconds_count") == 1
    assert growth(before, after, "e2e_request_latency_seconds_count") == 1
    for phase in ("queue", "prefill", "decode", "inference"):  # its first scheduling heard from the engine core
        assert growth(before, after, f"request_{phase}_time_seconds_count") == 1, phase
    phase_sum = {phase: growth(before, after, f"request_{phase}_time_seconds_sum") for phase in ("prefill", "decode")}
    assert growth(before, after, "request_inference_time_seconds_sum") == pytest.approx(sum(phase_sum.values()))
    assert growth(before, after, "inter_token_latency_seconds_count") == usage.completion_tokens - 1
    # one step per token, or per up to --decode-steps (8) tokens for a plan of several decode steps
    assert growth(before, after, "dataplane_step_seconds_count") >= usage.completion_tokens / 8
    assert growth(before, after, "e2e_request_latency_seconds_sum") >= growth(
        before, after, "time_to_first_token_seconds_sum") > 0
    # a histogram's +Inf bucket holds every observation
    assert after['twinplane:e2e_request_latency_seconds_bucket{le="+Inf"}'] == \
        after["twinplane:e2e_request_latency_seconds_count"]


def test_prefix_cache_counters_count_tokens(planes):
    prompt = random_prompts(1, seed=32, low=100, high=100)[0]
    before = scrape(planes)
    with planes.client() as client:
        usages = [list(client.generate(token_ids=prompt, max_tokens=4, **GREEDY))[-1].usage for _ in range(2)]
    after = scrape(planes)
    assert [u.cached_prompt_tokens for u in usages] == [0, 96]  # six full blocks of 16 on the second time
    assert growth(before, after, "prefix_cache_hits_total") == 96
    assert growth(before, after, "prefix_cache_queries_total") == 200
    assert growth(before, after, "num_preemptions_total") == 0


def test_success_counter_is_labelled_with_the_finish_reason(planes):
    prompt = random_prompts(1, seed=33, low=20, high=20)[0]
    with planes.client() as client:
        first_token = list(client.generate(token_ids=prompt, max_tokens=1, **GREEDY))[0].token_ids[0]
        before = scrape(planes)
        final = list(client.generate(token_ids=prompt, max_tokens=8, stop_token_ids=[first_token],
                                     temperature=0))[-1]
    after = scrape(planes)
    assert final.finish_reason == "stop_token"
    assert growth(before, after, 'request_success_total{finished_reason="stop_token"}') == 1
    assert growth(before, after, 'request_success_total{finished_reason="length"}') == 0


def generate_with_metadata(planes, metadata, **kwargs):
    """Runs Generate on the raw stub; returns (responses, initial metadata as a dict)."""
    with grpc.insecure_channel(planes.address) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(build_request(**kwargs), metadata=metadata, timeout=60)
        responses = list(call)
        return responses, dict(call.initial_metadata())


def test_request_id_from_metadata_is_echoed_and_logged(planes, caplog):
    caplog.set_level(logging.INFO, logger="twinplane.controlplane.requests")
    prompt = random_prompts(1, seed=34, low=20, high=20)[0]
    responses, echoed = generate_with_metadata(planes, (("x-request-id", "abc-123"),),
                                               token_ids=prompt, max_tokens=7, **GREEDY)
    assert echoed["x-request-id"] == "abc-123"
    assert {r.request_id for r in responses} == {"abc-123"}
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (20, 7)
    lines = [r.getMessage() for r in caplog.records if "'abc-123'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "reason=length prompt_tokens=20 output_tokens=7 cached_tokens=0 ttft=" in lines[0]
    assert "total=" in lines[0]


def test_request_id_without_metadata_is_echoed(planes):
    prompt = random_prompts(1, seed=35, low=5, high=5)[0]
    responses, echoed = generate_with_metadata(planes, (), token_ids=prompt, max_tokens=2, **GREEDY)
    assert len(echoed["x-request-id"]) == 32 and {r.request_id for r in responses} == {echoed["x-request-id"]}
    # the request's own field wins over the header
    responses, echoed = generate_with_metadata(planes, (("x-request-id", "from-header"),), request_id="from-field",
                                               token_ids=prompt, max_tokens=2, **GREEDY)
    assert echoed["x-request-id"] == "from-field" == responses[-1].request_id
    # characters a metadata value cannot hold are percent-encoded in the echo
    responses, echoed = generate_with_metadata(planes, (), request_id="é\x1c 1", token_ids=prompt, max_tokens=2,
                                               **GREEDY)
    assert echoed["x-request-id"] == "%C3%A9%1C%201" and responses[-1].request_id == "é\x1c 1"


def test_too_long_request_id_header_is_refused(planes):
    with pytest.raises(grpc.RpcError) as info:
        generate_with_metadata(planes, (("x-request-id", "x" * 300),), token_ids=[5, 6], max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-request-id must be at most 256 characters" in info.value.details()


def _control_plane_metrics(tmp_path, **config) -> tuple[str, int]:
    """Starts a control plane (no data plane needed) with /metrics; returns the metrics server's
    host, and the HTTP status of a scrape without and with the API key."""
    import asyncio

    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.main import ControlPlane, Security

    async def run():
        plane = ControlPlane(ControlPlaneConfig(dataplane=f"unix://{tmp_path}/none.sock", listen="0.0.0.0:0",
                                                metrics_port=0, **config), Security(api_key="m3trics-key"))
        await plane.start()
        try:
            host = plane.metrics_server.server_address[0]
            return host, [await asyncio.to_thread(_scrape_status, plane.metrics_port, key)
                          for key in (None, "wrong", "m3trics-key")]
        finally:
            await plane.shutdown(grace=0)

    return asyncio.run(asyncio.wait_for(run(), 120))


def _scrape_status(port: int, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers),
                                    timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_metrics_bind_to_loopback_and_need_the_api_key(tmp_path):
    """Even with the public API on 0.0.0.0, /metrics stays on 127.0.0.1 unless --metrics-host says
    otherwise; with an API key, a scrape must send it (Authorization: Bearer <key>)."""
    host, statuses = _control_plane_metrics(tmp_path)
    assert host == "127.0.0.1"
    assert statuses == [401, 401, 200]


def test_metrics_can_be_opened_explicitly(tmp_path):
    from twinplane.clients.cli import _controlplane, build_parser

    args = build_parser().parse_args(["controlplane", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"])
    config, _ = _controlplane(args, args.dataplane, None)
    assert (config.metrics_host, config.metrics_api_key) == ("127.0.0.1", True)
    args = build_parser().parse_args(["controlplane", "--metrics-port", "9400", "--metrics-no-auth"])
    assert _controlplane(args, args.dataplane, None)[0].metrics_api_key is False
    _, statuses = _control_plane_metrics(tmp_path, metrics_api_key=False)
    assert statuses == [200, 200, 200]


def test_the_ipv6_wildcard_takes_ipv4_too_and_falls_back_without_ipv6(monkeypatch):
    """'::' binds every address, IPv6 and IPv4 alike (as gRPC's [::] does), for /metrics and the HTTP
    API, so that one manifest serves either kind of cluster; on a host without IPv6 it is 0.0.0.0.
    Nothing is bound here: tests listen on loopback only."""
    import socket

    from twinplane.controlplane import openai_http
    from twinplane.controlplane.metrics import _MetricsServer
    from twinplane.controlplane.tls import every_address

    # /metrics: the socket it binds for '::' takes IPv4 too
    from wsgiref.simple_server import WSGIServer

    monkeypatch.setattr(WSGIServer, "server_bind", lambda self: None)  # no bind
    server = type("S", (_MetricsServer,), {"address_family": socket.AF_INET6})(("::", 0), None, False)
    server.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # a host with net.ipv6.bindv6only=1
    server.server_bind()
    assert server.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    server.server_close()

    # the HTTP API asks for a dual-stack socket for '::' only
    asked = []

    def create_server(address, **kwargs):
        asked.append((address[0], kwargs["dualstack_ipv6"]))
        raise OSError("not bound in a test")

    monkeypatch.setattr(openai_http.socket, "create_server", create_server)
    for listen in ("[::]:0", "[::1]:0", "127.0.0.1:0"):
        with pytest.raises(OSError, match="not bound in a test"):
            openai_http.HttpServer(None, listen)
    assert asked == [("::", socket.has_dualstack_ipv6()), ("::1", False), ("127.0.0.1", False)]

    # without IPv6, '::' is IPv4's every address
    assert [every_address(h) for h in ("::", "::1", "0.0.0.0")] == ["::", "::1", "0.0.0.0"]
    real_socket = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    assert [every_address(h) for h in ("::", "127.0.0.1")] == ["0.0.0.0", "127.0.0.1"]


# ---- the engine's counting, without the planes ------------------------------------------


def _engine_with_a_request(seq_id: int = 7):
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.request_state import RequestState
    from twinplane.controlplane.sequence import RequestParams

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere"))
    state = RequestState(seq_id, "r", [1, 2, 3], RequestParams(max_tokens=8), None, 1, engine.metrics, 0.0,
                         engine.unsent)
    engine.requests[seq_id] = state
    return engine, state


def _family(engine, name: str):
    from twinplane.controlplane.metrics import EngineCollector

    (family,) = [f for f in EngineCollector(engine).collect() if f.name == f"twinplane:{name}"]
    return family


def test_a_steps_tokens_of_one_request_go_out_in_one_message_that_times_each_token(monkeypatch):
    """A plan of several decode steps returns a request's tokens at once: one message carries them,
    and each counts the message's gap over its token count (not the whole gap, then zeros)."""
    from twinplane.controlplane.messages import TokenOutput

    engine, state = _engine_with_a_request()
    clock = iter([1.0, 1.3])
    monkeypatch.setattr("twinplane.controlplane.request_state.time", SimpleNamespace(monotonic=lambda: next(clock)))
    engine.step([TokenOutput(7, 5, 3, None, None, 0)], engine.core_snapshot)  # the first token, at 1.0
    engine.step([TokenOutput(7, token, 4 + i, None, None, 0) for i, token in enumerate((6, 7, 8))],
                engine.core_snapshot)  # three more, at 1.3
    assert [out.token_ids for out in state.outputs] == [[5], [6, 7, 8]]
    itl = engine.metrics.inter_token_latency
    assert sum(itl.counts) == 3 and itl.sum == pytest.approx(0.3)
    assert max(itl.counts) == 3  # three gaps of 0.1 s, in one bucket
    assert engine.metrics.time_to_first_token.sum == pytest.approx(1.0)


def test_a_finished_request_is_timed_in_its_phases_as_vllm_times_them(monkeypatch):
    """Queued from arrival (0.0) until the engine core first scheduled it (0.2, on its first token's output),
    prefill to its first token (1.0), decode to its last (1.3); inference from scheduled to last."""
    from twinplane.controlplane.messages import TokenOutput

    engine, state = _engine_with_a_request()
    clock = SimpleNamespace(monotonic=lambda: now)
    monkeypatch.setattr("twinplane.controlplane.request_state.time", clock)
    monkeypatch.setattr("twinplane.controlplane.engine.time", clock)
    now = 1.0
    engine.step([TokenOutput(7, 5, 3, None, None, 0, None, 0.2)], engine.core_snapshot)
    now = 1.3
    engine.step([TokenOutput(7, 6, 4, None, None, 0), TokenOutput(7, 7, 5, None, "length", 0)], engine.core_snapshot)
    m = engine.metrics
    assert m.finished["length"] == 1
    phases = {phase: getattr(m, f"request_{phase}_time") for phase in ("queue", "prefill", "decode", "inference")}
    assert all(sum(h.counts) == 1 for h in phases.values())
    assert {phase: round(h.sum, 6) for phase, h in phases.items()} == {
        "queue": 0.2, "prefill": 0.8, "decode": 0.3, "inference": 1.1}
    samples = {s.name: s.value for s in _family(engine, "request_prefill_time_seconds").samples}
    assert samples["twinplane:request_prefill_time_seconds_count"] == 1


def test_a_choice_added_after_its_request_arrived_is_timed_from_that_arrival():
    """An HTTP request's later choices join once its first has a token; each is timed from the arrival it
    is given (the request's), so its time to first token and end-to-end latency are what the client waited."""
    import asyncio
    import time

    from twinplane.controlplane.api import GenerateCall, Prompt
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.messages import TokenOutput
    from twinplane.controlplane.sequence import RequestParams
    from twinplane.proto import dataplane_pb2 as dp

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere"), link=lambda config, engine: SimpleNamespace(
        send=lambda message: None))
    engine.connected(dp.DescribeResponse(model="m", vocab_size=100, max_model_len=64, num_kv_blocks=16, block_size=16,
                                         max_logprobs=5), engine.core_snapshot)
    call = GenerateCall("r", Prompt(token_ids=[1, 2, 3]), RequestParams(max_tokens=1), choice=1)
    state = asyncio.run(engine.add(call, room_checked=True, arrival_time=time.monotonic() - 2.0))
    engine.step([TokenOutput(state.seq_id, 5, 3, None, "length", 0)], engine.core_snapshot)
    m = engine.metrics
    assert m.finished["length"] == 1 and m.time_to_first_token.sum >= 2.0 and m.e2e_request_latency.sum >= 2.0


def test_a_request_that_ends_with_an_error_is_counted_as_one():
    engine, state = _engine_with_a_request()
    engine.step_failed([7], "out of memory")
    assert engine.metrics.finished["error"] == 1 and sum(engine.metrics.finished.values()) == 1
    assert sum(engine.metrics.e2e_request_latency.counts) == 1
    assert sum(engine.metrics.request_queue_time.counts) == 0  # never scheduled, as far as the frontend heard
    prompt_tokens = engine.metrics.request_prompt_tokens
    assert sum(prompt_tokens.counts) == 1 and prompt_tokens.sum == 3
    samples = {s.labels["finished_reason"]: s.value for s in _family(engine, "request_success").samples}
    assert samples["error"] == 1 and samples["length"] == 0


def test_a_data_planes_counters_carry_on_across_engine_cores():
    from twinplane.controlplane.messages import DataPlaneSnapshot

    engine, _ = _engine_with_a_request()
    part = DataPlaneSnapshot("dp:1", connected=True, computed_tokens=500, prefix_cache_hits=64)
    engine.snapshot(replace(engine.core_snapshot, dataplanes=[part]))
    engine.core_died()
    assert engine.core_snapshot.prefix_cache_hits == 64  # the total too, which the next core is given

    def values(name: str) -> list[float]:
        return [s.value for s in _family(engine, name).samples]

    assert values("dataplane_computed_tokens") == [500] and values("dataplane_prefix_cache_hits") == [64]
    restarted = replace(part, computed_tokens=20, prefix_cache_hits=16)  # the new core counts from 0
    engine.snapshot(replace(engine.core_snapshot, dataplanes=[restarted]))
    assert values("dataplane_computed_tokens") == [520] and values("dataplane_prefix_cache_hits") == [80]


def test_get_stats_gives_each_data_plane_its_counts_of_every_engine_core():
    """A new engine core counts each data plane's steps, tokens, preemptions and prefix-cache lookups from 0;
    GetStats's DataPlaneStats carry on from the cores before it, as the totals beside them do, which they sum to."""
    import asyncio

    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.messages import DataPlaneSnapshot
    from twinplane.controlplane.server import GenerationServicer
    from twinplane.proto import generation_pb2 as pb

    engine, _ = _engine_with_a_request()
    target = engine.config.dataplanes[0]
    first = dict(steps=10, computed_tokens=500, num_preemptions=3, prefix_cache_queries=100, prefix_cache_hits=64)
    stats = dict(engine.core_snapshot.stats, steps=10, computed_tokens=500)
    engine.snapshot(replace(engine.core_snapshot, stats=stats, dataplanes=[DataPlaneSnapshot(target, True, **first)]))
    engine.core_died()
    snapshot = EngineCore(engine.config, SimpleNamespace(send=None), engine.core_snapshot).snapshot()  # the next core
    snapshot.dataplanes = [DataPlaneSnapshot(target, True, steps=2, computed_tokens=20, num_preemptions=1,
                                             prefix_cache_queries=30, prefix_cache_hits=16)]
    snapshot.stats["steps"] += 2
    snapshot.stats["computed_tokens"] += 20
    engine.snapshot(snapshot)
    engine.ready.set()
    reply = asyncio.run(GenerationServicer(engine).GetStats(pb.GetStatsRequest(), None))
    names = ("steps", "computed_tokens", "preemptions", "prefix_cache_queries", "prefix_cache_hits")
    assert [getattr(reply, name) for name in names] == [12, 520, 4, 130, 80]
    assert [getattr(reply.dataplanes[0], name) for name in names] == [12, 520, 4, 130, 80]


def test_a_new_engine_core_counts_on_from_the_one_it_replaces():
    """Preemptions and prefix-cache queries and hits carry on across engine cores, on /metrics too; the
    gauges (waiting, running, KV blocks) are the new core's data planes' alone."""
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine_core import EngineCore
    from twinplane.controlplane.messages import CoreSnapshot, DataPlaneSnapshot
    from twinplane.controlplane.replica import STAT_NAMES

    earlier = DataPlaneSnapshot("earlier cores", num_preemptions=1, prefix_cache_queries=30, prefix_cache_hits=8)
    dying = DataPlaneSnapshot("dp:1", True, waiting=2, running=3, free_kv_blocks=5, num_kv_blocks=16,
                              num_preemptions=4, prefix_cache_queries=100, prefix_cache_hits=32)
    before = CoreSnapshot(dict.fromkeys(STAT_NAMES, 0), unrouted=1, earlier=earlier, dataplanes=[dying])
    core = EngineCore(ControlPlaneConfig(dataplane="unix:///nowhere"), SimpleNamespace(send=None), before)
    snapshot = core.snapshot()
    assert (snapshot.num_preemptions, snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (5, 130, 40)
    snapshot.unrouted = 3  # and the new core's data plane has done some work
    snapshot.dataplanes = [DataPlaneSnapshot("dp:1", True, waiting=1, running=2, free_kv_blocks=12, num_kv_blocks=16,
                                             num_preemptions=2, prefix_cache_queries=20, prefix_cache_hits=4)]
    assert (snapshot.waiting, snapshot.running, snapshot.free_kv_blocks, snapshot.num_kv_blocks) == (4, 2, 12, 16)
    engine, _ = _engine_with_a_request()
    engine.snapshot(snapshot)
    names = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_requests_running",
             "kv_cache_usage_perc")
    assert {name: _family(engine, name).samples[0].value for name in names} == {
        "num_preemptions": 7, "prefix_cache_queries": 150, "prefix_cache_hits": 44, "num_requests_running": 2,
        "kv_cache_usage_perc": 0.25}


def test_the_primary_frontends_metrics_count_every_frontends_requests():
    """With several frontends, the primary's /metrics sums the request counters and histograms of all of
    them (the others' as they last reported them); an observation on a bucket's bound is in that bucket."""
    from twinplane.controlplane.metrics import EngineCollector, EngineMetrics

    engine, _ = _engine_with_a_request()
    own, other = engine.metrics, EngineMetrics()
    own.prompt_tokens, own.generation_tokens, own.finished["length"] = 3, 10, 1
    other.prompt_tokens, other.generation_tokens, other.finished["stop_token"] = 5, 7, 2
    own.e2e_request_latency.observe(0.1)
    other.e2e_request_latency.observe(2.0, count=2)
    collected = EngineCollector(engine, SimpleNamespace(metrics={1: other})).collect()
    samples = {(s.name, s.labels.get("finished_reason") or s.labels.get("le")): s.value
               for family in collected for s in family.samples}
    assert samples["twinplane:prompt_tokens_total", None] == 8
    assert samples["twinplane:generation_tokens_total", None] == 17
    success = "twinplane:request_success_total"
    assert (samples[success, "length"], samples[success, "stop_token"], samples[success, "error"]) == (1, 2, 0)
    latency = "twinplane:e2e_request_latency_seconds"
    assert [samples[f"{latency}_bucket", le] for le in ("0.1", "1.0", "2.5", "+Inf")] == [1, 1, 3, 3]
    assert (samples[f"{latency}_count", None], samples[f"{latency}_sum", None]) == (3, pytest.approx(4.1))


# ---- the metrics server ---------------------------------------------------------------------


@pytest.fixture
def metrics_server():
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.controlplane.metrics import registry_for, serve_metrics

    server = serve_metrics(registry_for(Engine(ControlPlaneConfig(dataplane="unix:///nowhere"))), "127.0.0.1", 0)
    yield server
    server.shutdown()
    server.server_close()


def _get(server, path: str, headers: dict | None = None):
    url = f"http://127.0.0.1:{server.server_port}{path}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
        return response.headers, response.read()


def _names(text: bytes) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_a_scrape_gets_gzip_when_it_asks_and_only_the_names_it_asks_for(metrics_server):
    import gzip

    headers, body = _get(metrics_server, "/metrics")
    assert headers["Content-Encoding"] is None and {"twinplane:num_requests_running",
                                                    "twinplane:prompt_tokens_total"} <= _names(body)
    headers, zipped = _get(metrics_server, "/metrics", {"Accept-Encoding": "gzip"})  # as Prometheus asks
    assert headers["Content-Encoding"] == "gzip" and int(headers["Content-Length"]) == len(zipped)
    assert _names(gzip.decompress(zipped)) == _names(body)
    assert _get(metrics_server, "/metrics", {"Accept-Encoding": "gzip;q=0, identity"})[0]["Content-Encoding"] is None
    # samples by name, or a whole family (a histogram's buckets, sum and count) by its name
    _, some = _get(metrics_server, "/metrics?name[]=twinplane:num_requests_running"
                                   "&name[]=twinplane:prompt_tokens_total&name[]=twinplane:e2e_request_latency_seconds")
    assert _names(some) == {"twinplane:num_requests_running", "twinplane:prompt_tokens_total",
                            "twinplane:e2e_request_latency_seconds_bucket", "twinplane:e2e_request_latency_seconds_sum",
                            "twinplane:e2e_request_latency_seconds_count"}


def test_a_scrape_that_refuses_gzip_in_capitals_gets_plain_text(metrics_server):
    """The weight's name is case-insensitive (RFC 9110): 'GZIP; Q=0' refuses gzip as 'gzip;q=0' does."""
    assert _get(metrics_server, "/metrics", {"Accept-Encoding": "GZIP; Q=0, identity"})[0]["Content-Encoding"] is None
    assert _get(metrics_server, "/metrics", {"Accept-Encoding": "GZIP; Q=0.5"})[0]["Content-Encoding"] == "gzip"


def test_slow_connections_cannot_keep_a_scrape_out(metrics_server, monkeypatch):
    """Connections past the cap wait their turn, and none keeps its turn past the timeout however it
    trickles its request: a scrape behind a full house of slow clients is still answered."""
    import socket
    import threading
    import time

    from tests.reliability import wait_until
    from twinplane.controlplane import metrics

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT", 2.0)
    port, closed_after = metrics_server.server_port, []

    def trickle() -> None:  # a byte every 0.2 s, never a whole request
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            # timed from the connection on: a busy machine may be slow to connect, which is no time the
            # server held a turn
            started = time.monotonic()
            try:
                while time.monotonic() - started < 8:
                    sock.sendall(b"G")
                    time.sleep(0.2)
            except OSError:  # closed by the server
                pass
            closed_after.append(time.monotonic() - started)

    slow = [threading.Thread(target=trickle) for _ in range(metrics.MAX_SCRAPES)]
    for thread in slow:
        thread.start()
    wait_until(lambda: metrics_server.slots._value == 0, 10, "the slow connections to take every slot")
    # the scrape waits up to 2 s for a slot; the first frees ~2 s after it was taken: ~1 s to spare either way
    time.sleep(1.0)
    assert "twinplane:num_requests_running" in _names(_get(metrics_server, "/metrics")[1])
    for thread in slow:
        thread.join(15)
    assert len(closed_after) == metrics.MAX_SCRAPES and max(closed_after) < 5, closed_after


def test_connections_past_the_cap_queue_rather_than_lose_their_syn(metrics_server, monkeypatch):
    """While every slot is taken, the kernel queues the connections that come (up to LISTEN_BACKLOG)
    instead of dropping their SYNs, each of which would cost its client a one-second retry."""
    import socket
    import struct

    from tests.reliability import wait_until
    from twinplane.controlplane import metrics

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT", 60.0)  # no slot or wait ends while the test counts the queue
    def accept_queue() -> tuple[int, int]:  # a listening socket's TCP_INFO: unacked = queued, sacked = the cap
        info = metrics_server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        fields = struct.unpack_from("8B6I", info)
        return fields[12], fields[13]

    port, extra = metrics_server.server_port, 40
    assert accept_queue()[1] >= min(metrics.LISTEN_BACKLOG, int(open("/proc/sys/net/core/somaxconn").read())) > extra
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(metrics.MAX_SCRAPES)]
    waiting: list[socket.socket] = []
    try:
        wait_until(lambda: metrics_server.slots._value == 0, 10, "the idle connections to take every slot")
        waiting.append(socket.create_connection(("127.0.0.1", port), timeout=10))  # accepted, waits for a slot
        wait_until(lambda: accept_queue()[0] == 0, 10, "the server to take the connection that waits for a slot")
        for _ in range(extra):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            waiting.append(sock)
        wait_until(lambda: accept_queue()[0] == extra, 5, f"all {extra} connections in the accept queue")
    finally:
        for sock in idle + waiting:
            sock.close()
    assert "twinplane:num_requests_running" in _names(_get(metrics_server, "/metrics")[1])


def _raw(server, request: bytes) -> bytes:
    """What the server answers to request bytes, read until it closes the connection."""
    import socket

    answer = b""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=20) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_head_request_gets_the_headers_alone(metrics_server):
    head, _, body = _raw(metrics_server, b"HEAD /metrics HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"Content-Length: " in head and body == b""
    _, _, body = _raw(metrics_server, b"GET /metrics HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    assert b"twinplane:num_requests_running" in body


def test_a_request_head_past_its_bound_is_dropped_at_once(metrics_server, monkeypatch):
    """A connection that sends more than MAX_REQUEST_HEAD bytes of request line and headers is closed
    as soon as they have come, not when its time runs out."""
    import time

    from twinplane.controlplane import metrics

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT", 120.0)
    started = time.monotonic()
    try:
        answer = _raw(metrics_server, b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"a" * (2 * metrics.MAX_REQUEST_HEAD))
    except ConnectionError:  # closed while it still sent, or with some of it unread
        answer = b""
    assert answer == b"" and time.monotonic() - started < 20
