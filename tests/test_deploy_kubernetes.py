"""deploy/kubernetes as kustomize builds it, checked offline: schemas, and what the pieces must say.

No cluster is reached: `kubectl kustomize` renders the manifests, `kubernetes-validate` checks each
resource against the Kubernetes API schemas, and the tests read what the rendered resources say.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.test_boundaries import ROOT
from twinplane.clients.cli import build_parser

FOLDER = ROOT / "deploy" / "kubernetes"


@functools.cache
def _rendered() -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", str(FOLDER)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(r for r in yaml.safe_load_all(out.stdout) if r)


@pytest.fixture
def resources() -> dict[tuple[str, str], dict]:
    if shutil.which("kubectl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl is not installed (.ci/run installs it)")
        pytest.skip("needs kubectl (apt-get install kubernetes-client)")
    return {(r["kind"], r["metadata"]["name"]): r for r in _rendered()}


def _one(resources: dict, kind: str) -> dict:
    found = [r for (k, _), r in resources.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict, config: dict) -> dict[str, str]:
    """The container's environment: ConfigMap values resolved, Secret keys as <secret/key>."""
    env = {}
    for var in container["env"]:
        source = var.get("valueFrom", {})
        if "configMapKeyRef" in source:
            env[var["name"]] = config["data"][source["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = f"<{ref['name']}/{ref['key']}>"
        else:
            env[var["name"]] = var["value"]
    return env


def _args(container: dict, env: dict) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]


def test_every_resource_passes_the_kubernetes_schemas(resources):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for resource in resources.values():
        kubernetes_validate.validate(resource, version, strict=True)  # raises on the first error
    assert {kind for kind, _ in resources} >= {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "ConfigMap"}


def test_data_planes_are_a_gpu_statefulset_behind_a_headless_service(resources):
    sts = _one(resources, "StatefulSet")
    service = resources[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"  # one DNS name per pod: the control plane routes
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    container = _container(sts)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50061  # grpc.health.v1, open without the token
    env = _env(container, _one(resources, "ConfigMap"))
    assert env["TWINPLANE_DATAPLANE_TOKEN"] == "<twinplane-secrets/dataplane-token>"
    args = build_parser().parse_args(_args(container, env))
    assert args.command == "dataplane" and args.listen == "0.0.0.0:50061"


def test_the_control_plane_addresses_every_data_plane_pod(resources):
    sts, deployment = _one(resources, "StatefulSet"), _one(resources, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = _container(deployment)
    env = _env(container, _one(resources, "ConfigMap"))
    assert env["TWINPLANE_DATAPLANE_TOKEN"] == "<twinplane-secrets/dataplane-token>"
    assert env["TWINPLANE_API_KEY"] == "<twinplane-secrets/api-key>"
    args = build_parser().parse_args(_args(container, env))
    assert args.command == "controlplane"
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert args.dataplane.split(",") == [f"{name}-{i}.{service}:50061" for i in range(sts["spec"]["replicas"])]
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    ports = {p["name"]: p["port"] for p in resources[("Service", "twinplane")]["spec"]["ports"]}
    assert ports == {"grpc": 50051, "metrics": int(args.metrics_port)}


def test_only_the_control_plane_reaches_the_data_planes(resources):
    policy = _one(resources, "NetworkPolicy")["spec"]
    sts, deployment = _one(resources, "StatefulSet"), _one(resources, "Deployment")
    assert policy["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source == {"podSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}}
    assert rule["ports"] == [{"protocol": "TCP", "port": 50061}]
