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
from pathlib import Path

import pytest
import yaml

from tests.test_boundaries import ROOT
from twinplane.clients.cli import build_parser

FOLDER = ROOT / "deploy" / "kubernetes"


@functools.cache
def _rendered(folder: Path = FOLDER) -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
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


def _env(container: dict, resources: dict) -> dict[str, str]:
    """The container's environment: ConfigMap values resolved, Secret keys as <secret/key>."""
    env = {}
    for var in container["env"]:
        source = var.get("valueFrom", {})
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = resources[("ConfigMap", ref["name"])]["data"][ref["key"]]
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
    env = _env(container, resources)
    assert env["TWINPLANE_DATAPLANE_TOKEN"] == "<twinplane-secrets/dataplane-token>"
    args = build_parser().parse_args(_args(container, env))
    assert args.command == "dataplane" and args.listen == "[::]:50061"
    # grpc.health.v1, open without the token, in plaintext on a port of its own (probes speak no TLS)
    health_port = int(args.health_listen.rpartition(":")[2])
    assert health_port != 50061
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health_port
    assert {"name": "health", "containerPort": health_port} in container["ports"]


def _mounted_secret(workload: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at path in the workload's container."""
    spec = workload["spec"]["template"]["spec"]
    (mount,) = [m for m in _container(workload)["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly"), mount
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    file = path.removeprefix(mount["mountPath"] + "/")
    (item,) = [i for i in volume["secret"]["items"] if i["path"] == file]
    return volume["secret"]["secretName"], item["key"]


def _secret_keys(workload: dict, secret: str) -> set[str]:
    """Every key of the Secret that the workload mounts."""
    volumes = workload["spec"]["template"]["spec"]["volumes"]
    return {i["key"] for v in volumes if v.get("secret", {}).get("secretName") == secret for i in v["secret"]["items"]}


def test_the_planes_speak_tls_verified_by_the_service_name(resources):
    """The data planes serve TLS with a mounted certificate; the control plane verifies it with the CA
    alone (never the key), for the name the certificate carries: the headless Service's."""
    sts, deployment = _one(resources, "StatefulSet"), _one(resources, "Deployment")
    dp_container, cp_container = _container(sts), _container(deployment)
    dp_args = build_parser().parse_args(_args(dp_container, _env(dp_container, resources)))
    cp_args = build_parser().parse_args(_args(cp_container, _env(cp_container, resources)))
    secret = "twinplane-dataplane-tls"
    assert _mounted_secret(sts, dp_args.tls_cert) == (secret, "tls.crt")
    assert _mounted_secret(sts, dp_args.tls_key) == (secret, "tls.key")
    assert _mounted_secret(deployment, cp_args.dataplane_tls_ca) == (secret, "ca.crt")
    assert _secret_keys(deployment, secret) == {"ca.crt"}
    service = sts["spec"]["serviceName"]
    assert cp_args.dataplane_tls_server_name == service
    kustomization = (FOLDER / "kustomization.yaml").read_text()  # how to make the certificate
    assert f"subjectAltName=DNS:{service}" in kustomization and f"secret generic {secret}" in kustomization


def test_the_control_plane_addresses_every_data_plane_pod(resources):
    sts, deployment = _one(resources, "StatefulSet"), _one(resources, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = _container(deployment)
    env = _env(container, resources)
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


def test_a_longer_data_plane_list_restarts_the_control_plane_and_no_data_plane(resources, tmp_path):
    """Scaling out changes the list of data planes: the control plane's pod must change (it reads the
    list at start), the running data planes' must not (each would reload its weights)."""
    folder = tmp_path / "kubernetes"
    shutil.copytree(FOLDER, folder)
    kustomization = (folder / "kustomization.yaml").read_text()
    listed = re.search(r"DATAPLANES=(\S+)", kustomization).group(1)
    third = "twinplane-dataplane-2.twinplane-dataplane:50061"
    (folder / "kustomization.yaml").write_text(kustomization.replace(listed, f"{listed},{third}"))
    scaled = {(r["kind"], r["metadata"]["name"]): r for r in _rendered(folder)}
    deployment, before = _one(scaled, "Deployment"), _one(resources, "Deployment")
    assert _env(_container(deployment), scaled)["DATAPLANES"].endswith(third)
    assert deployment["spec"]["template"] != before["spec"]["template"]
    assert _one(scaled, "StatefulSet") == _one(resources, "StatefulSet")


def test_every_pod_runs_unprivileged_and_the_data_planes_are_not_evicted_first(resources):
    for workload in (_one(resources, "StatefulSet"), _one(resources, "Deployment")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the images' user (docker/*.Dockerfile)
        container = _container(workload)["securityContext"]
        assert container["allowPrivilegeEscalation"] is False and container["capabilities"]["drop"] == ["ALL"]
        # the Secrets' files are readable by the pod's group, which fsGroup gives them
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == 10001
        assert {"cpu", "memory"} <= set(_container(workload)["resources"]["requests"])


def test_every_container_port_is_one_its_image_exposes(resources):
    """Each port a pod names is EXPOSEd by the Dockerfile that builds its image (named in the
    Dockerfile's `docker build ... -t IMAGE` line)."""
    exposed = {}
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        (image,) = re.findall(r"docker build -f \S+ -t (\S+)", text)
        exposed[image] = {int(port) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for port in line.split()}
    for workload in (_one(resources, "StatefulSet"), _one(resources, "Deployment")):
        container = _container(workload)
        image = re.sub(r":[^/:]+$", "", container["image"])  # the tag kustomize sets left out
        ports = {port["containerPort"] for port in container["ports"]}
        assert ports and ports <= exposed[image], (image, ports, exposed)
