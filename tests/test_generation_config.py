"""The model's generation_config.json as the defaults of the fields requests leave unset, as vLLM's
(``controlplane/generation_config.py``): which defaults are in force under --generation-config and
--override-generation-config, their checks at start-up, and requests that leave fields unset over gRPC and
HTTP on both planes (CPU). What is observable decides: a default temperature of 0 or top_k of 1 makes
a request greedy, and a default max_tokens the number of tokens it runs to (with ignore_eos)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import Planes
from twinplane.controlplane.api import GenerateCall, Limits, Prompt, sampling_from_pb, sampling_options
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.generation_config import GenerationConfigError, server_defaults
from twinplane.controlplane.openai_api import parse_request
from twinplane.controlplane.sequence import RequestParams
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import generation_pb2 as pb

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512}  # as the data plane describes it
# the file of the model the planes below serve, and the override of the planes that take one
FILE = {"bos_token_id": 1, "eos_token_id": [2], "do_sample": True, "temperature": 0, "top_p": 0.9, "top_k": 5,
        "max_new_tokens": 6}
OVERRIDE = {"top_k": 1, "max_new_tokens": 4}
SEED = 7


# ---- which defaults are in force, without the planes ------------------------------------------------


def test_auto_serves_the_keys_the_file_writes_with_the_override_over_them():
    assert server_defaults("auto", {}, QWEN3) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    override = {"temperature": 0.5, "top_k": None, "min_p": 0.1}  # a null: back to the built-in default
    assert server_defaults("auto", override, QWEN3) == {"temperature": 0.5, "top_p": 0.95, "min_p": 0.1,
                                                        "max_tokens": 512}


def test_vllm_ignores_the_file_but_not_the_override():
    assert server_defaults("vllm", {}, QWEN3) == {}
    assert server_defaults("vllm", {"temperature": 0.5, "max_new_tokens": 9}, QWEN3) == {"temperature": 0.5,
                                                                                         "max_tokens": 9}


def test_a_folder_serves_its_own_file_not_the_data_planes(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**FILE, "min_p": None}))
    assert server_defaults(str(tmp_path), {"top_k": 1}, QWEN3) == {"temperature": 0, "top_p": 0.9, "top_k": 1,
                                                                  "max_tokens": 6}


def test_a_request_field_wins_over_the_defaults_and_those_over_the_built_in_ones():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 9}
    options = sampling_options({"temperature": 1.0}, defaults=defaults)
    assert (options.temperature, options.top_k, options.top_p) == (1.0, 20, 1.0)
    assert sampling_from_pb(pb.SamplingParams(temperature=0), defaults).temperature == 0.0  # set, even to 0
    assert sampling_from_pb(pb.SamplingParams(), defaults).temperature == pytest.approx(0.6)
    assert sampling_from_pb(pb.SamplingParams()).temperature == 1.0
    limits = Limits(vocab_size=100, max_model_len=64, defaults=defaults)
    for body, temperature in (({}, 0.6), ({"temperature": None}, 0.6), ({"temperature": 0}, 0.0)):
        params = parse_request({"prompt": "hi", **body}, limits, "r", chat=False).calls[0].params
        assert (params.sampling.temperature, params.sampling.top_k) == (pytest.approx(temperature), 20)
        assert params.max_tokens == 0  # the engine fills in the default once the prompt's length is known


# ---- checks at start-up: a bad value names its file or flag, and how to start anyway ---------------------


def test_a_bad_override_or_folder_is_refused_at_start_up_naming_it(tmp_path):
    from twinplane.clients.cli import _controlplane, build_parser
    from twinplane.controlplane.ipc import ConfigExit

    def refusal(**config) -> str:
        with pytest.raises(ValueError) as error:
            ControlPlaneConfig(dataplane="x", **config)
        return str(error.value)

    assert refusal(override_generation_config={"temperature": -1}).startswith(
        "--override-generation-config: temperature must be a finite number >= 0")
    assert "max_new_tokens must be >= 1, got 0; give --override-generation-config a value" in refusal(
        override_generation_config={"max_new_tokens": 0})
    assert "top_k must be a 64-bit integer, got '20'" in refusal(override_generation_config={"top_k": "20"})
    assert "takes the keys temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; got " \
           "temprature" in refusal(override_generation_config={"temprature": 1})
    assert "a folder holding generation_config.json, got" in refusal(generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    assert refusal(generation_config=str(tmp_path)) == (
        f"{tmp_path / 'generation_config.json'}: top_p must be in (0.0, 1.0], got 0; mend the file, or start the "
        "control plane with --override-generation-config '{\"top_p\": null}' (the built-in default) or "
        "--generation-config vllm (none of the file's defaults)")
    assert ControlPlaneConfig(dataplane="x", generation_config=str(tmp_path),
                              override_generation_config={"top_p": None})  # what the message says works
    args = build_parser().parse_args(["serve", "--override-generation-config", '{"repetition_penalty": 0}'])
    with pytest.raises(ConfigExit, match="twinplane serve: --override-generation-config: repetition_penalty must be"):
        _controlplane(args, "unix:///tmp/dp.sock", None)
    args = build_parser().parse_args(["serve", "--generation-config", "vllm", "--override-generation-config",
                                      '{"temperature": 0.5}'])
    config = _controlplane(args, "unix:///tmp/dp.sock", None)[0]
    assert (config.generation_config, config.override_generation_config) == ("vllm", {"temperature": 0.5})
    config = _controlplane(build_parser().parse_args(["serve"]), "unix:///tmp/dp.sock", None)[0]
    assert (config.generation_config, config.override_generation_config) == ("auto", {})


def _engine(index: int = 0, **config):
    from twinplane.controlplane.engine import Engine

    return Engine(ControlPlaneConfig(dataplane="unix:///nowhere", **config), index,
                  link=lambda config, engine: SimpleNamespace(send=lambda message: None))


def _describe(**generation_config) -> dp.DescribeResponse:
    return dp.DescribeResponse(model="m", vocab_size=100, max_model_len=64, num_kv_blocks=16, block_size=16,
                               max_logprobs=5, generation_config=generation_config)


def test_a_frontend_takes_the_data_planes_defaults_logs_them_once_and_caps_max_tokens(caplog):
    engine = _engine(override_generation_config={"max_new_tokens": 4})
    with caplog.at_level(logging.INFO, "twinplane.controlplane"):
        engine.connected(_describe(temperature=0.0, max_new_tokens=8), engine.core_snapshot)
        engine.connected(_describe(temperature=0.0, max_new_tokens=8), engine.core_snapshot)  # a second data plane
        _engine(1).connected(_describe(temperature=0.0), engine.core_snapshot)  # frontend 1: frontend 0 logs them
    assert engine.limits.defaults == {"temperature": 0.0, "max_tokens": 4}
    logged = [r.getMessage() for r in caplog.records if "requests leave unset" in r.getMessage()]
    assert logged == ["defaults of the fields requests leave unset: {'temperature': 0.0, 'max_tokens': 4} "
                      "(--generation-config auto and --override-generation-config)"]

    def max_tokens(prompt_len: int, min_tokens: int = 0) -> tuple[int, bool]:
        call = GenerateCall("r", Prompt(token_ids=[1] * prompt_len), RequestParams(0, min_tokens=min_tokens))
        params = asyncio.run(engine.add(call, room_checked=True)).params
        return params.max_tokens, params.max_tokens_unset

    assert max_tokens(10) == (4, True)  # lowered again if a data plane comes back smaller
    assert max_tokens(62) == (2, True)  # what fits in max_model_len
    with pytest.raises(InvalidRequest, match=r"min_tokens \(5\) must not exceed max_tokens \(4, the server's"):
        max_tokens(10, min_tokens=5)


def test_a_data_planes_default_out_of_range_stops_the_frontend_saying_how_to_start_anyway():
    with pytest.raises(GenerationConfigError) as error:
        _engine().connected(_describe(temperature=-1.0), None)
    assert str(error.value) == (
        "the model's generation_config.json (read by the data plane): temperature must be a finite number >= 0 (as "
        "a 32-bit float; 0 = greedy), got -1.0; mend the file, or start the control plane with "
        "--override-generation-config '{\"temperature\": null}' (the built-in default) or --generation-config vllm "
        "(none of the file's defaults)")
    for config in ({"override_generation_config": {"temperature": None}}, {"generation_config": "vllm"}):
        engine = _engine(**config)
        engine.connected(_describe(temperature=-1.0, top_k=3), engine.core_snapshot)
        assert engine.limits.defaults == ({"top_k": 3} if "override_generation_config" in config else {})


# ---- requests on both planes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_with_defaults(tiny_qwen3_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3, its generation_config.json setting sampling defaults (greedy) and max_new_tokens."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-defaults")
    shutil.copytree(tiny_qwen3_dir, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


def _planes(tmp_path_factory, model: Path, **config) -> Planes:
    return Planes(tmp_path_factory.mktemp("planes"), model, ("--block-size", "16", "--max-model-len", "128"),
                  **config).start()


@pytest.fixture(scope="module")
def planes(model_with_defaults, tmp_path_factory):
    """The file's defaults (--generation-config auto) with OVERRIDE over them, the HTTP API on loopback."""
    planes = _planes(tmp_path_factory, model_with_defaults, http_listen="127.0.0.1:0",
                     override_generation_config=OVERRIDE)
    yield planes
    planes.stop()


def _ids(planes: Planes, **request) -> list[int]:
    with planes.client() as client:
        return [i for chunk in client.generate("Hello there", ignore_eos=True, timeout=60, **request)
                for i in chunk.token_ids]


def _defaults(planes: Planes) -> dict:
    with planes.client() as client:
        return client.model_info(timeout=30).generation_defaults


def test_model_info_shows_the_defaults_in_force(planes):
    assert _defaults(planes) == {"temperature": 0.0, "top_p": pytest.approx(0.9), "top_k": 1, "max_tokens": 4}


def test_grpc_requests_take_their_own_fields_then_the_override_then_the_file(planes):
    greedy = _ids(planes, temperature=0, max_tokens=4)
    assert len(greedy) == 4
    assert _ids(planes) == greedy  # the file's temperature 0, the override's max_new_tokens over the file's
    assert _ids(planes, temperature=1.0, seed=SEED) == greedy  # the override's top_k 1 over the file's 5
    assert _ids(planes, temperature=1.0, seed=SEED, top_k=0)[:4] != greedy  # the request's own top_k
    assert len(_ids(planes, max_tokens=3)) == 3


def _completion(planes: Planes, **body) -> tuple[str, int]:
    url = f"http://127.0.0.1:{planes.plane.http_port}/v1/completions"
    reply = httpx.post(url, json={"prompt": "Hello there", "ignore_eos": True, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def test_http_requests_take_their_own_fields_then_the_override_then_the_file(planes):
    greedy = _completion(planes, temperature=0, max_tokens=4)
    assert greedy[1] == 4
    assert _completion(planes) == greedy == _completion(planes, temperature=None, max_tokens=None)
    assert _completion(planes, temperature=1.0, seed=SEED) == greedy
    assert _completion(planes, temperature=1.0, seed=SEED, top_k=0, max_tokens=4)[0] != greedy[0]
    assert _completion(planes, max_tokens=3)[1] == 3


def test_vllm_ignores_the_models_file_but_takes_the_override(model_with_defaults, tmp_path_factory):
    planes = _planes(tmp_path_factory, model_with_defaults, generation_config="vllm",
                     override_generation_config={"max_new_tokens": 3})
    try:
        assert _defaults(planes) == {"max_tokens": 3}
        assert len(_ids(planes)) == 3
        assert _ids(planes, seed=SEED) != _ids(planes, temperature=0)  # the built-in temperature 1, top_k off
    finally:
        planes.stop()


def test_a_folder_given_serves_its_file_over_a_model_without_one(tiny_qwen3_dir, model_with_defaults,
                                                                 tmp_path_factory):
    planes = _planes(tmp_path_factory, tiny_qwen3_dir, generation_config=str(model_with_defaults))
    try:
        assert _defaults(planes) == {"temperature": 0.0, "top_p": pytest.approx(0.9), "top_k": 5, "max_tokens": 6}
        assert _ids(planes) == _ids(planes, temperature=0, max_tokens=6)
    finally:
        planes.stop()


def test_every_frontend_applies_the_defaults(model_with_defaults, planes_factory):
    """With --api-server-count 2, each frontend process takes the defaults from the engine core's Connected."""
    from tests.test_frontends import _clients_by_frontend, _close

    planes = planes_factory(model_with_defaults, "--block-size", "16", "--max-model-len", "128",
                            listen="127.0.0.1:0", api_server_count=2, override_generation_config=OVERRIDE)

    async def seen_by(client) -> tuple[dict, int]:
        tokens = [len(chunk.token_ids) async for chunk in client.generate("Hello", ignore_eos=True)]
        return (await client.model_info()).generation_defaults, sum(tokens)

    async def each_frontend() -> dict[int, tuple[dict, int]]:
        found = await _clients_by_frontend(planes.address, 2, per_frontend=1)
        try:
            return {i: await seen_by(client) for i, (client,) in found.items()}
        finally:
            await _close(found)

    expected = ({"temperature": 0.0, "top_p": pytest.approx(0.9), "top_k": 1, "max_tokens": 4}, 4)
    assert asyncio.run(each_frontend()) == {0: expected, 1: expected}


def test_a_models_default_out_of_range_stops_the_control_plane_in_one_line(model_with_defaults, tmp_path):
    """Known once the data plane describes the model: the control plane exits non-zero, naming the file and how
    to start anyway (no traceback), rather than serving requests a default makes fail."""
    model = tmp_path / "model"
    shutil.copytree(model_with_defaults, model)
    (model / "generation_config.json").write_text(json.dumps({**FILE, "top_k": -2}))
    planes = Planes(tmp_path, model, ("--block-size", "16", "--max-model-len", "128"))
    try:
        planes.start_dataplane()
        result = subprocess.run([sys.executable, "-m", "twinplane.clients.cli", "controlplane", "--dataplane",
                                 planes.dp_address, "--listen", "127.0.0.1:0"],
                                capture_output=True, text=True, timeout=180)
    finally:
        planes.stop()
    assert result.returncode != 0
    assert ("a generation default is out of range: the model's generation_config.json (read by the data plane): "
            "top_k must be in [-1, 2147483647] (0 or -1 for no limit), got -2; mend the file, or start the control "
            "plane with --override-generation-config '{\"top_k\": null}'") in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
