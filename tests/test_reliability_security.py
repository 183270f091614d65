"""Security and discovery: loopback by default, TLS, API key, data-plane token, health, reflection, no pickle."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.reliability import GREEDY
from twinplane.clients.cli import build_parser
from twinplane.clients.client import Client
from twinplane.controlplane.config import ControlPlaneConfig
from twinplane.controlplane.dataplane_client import DataPlaneLost, DataPlaneClient
from twinplane.controlplane.main import Security
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

API_KEY, DP_TOKEN = "k3y-for-tests", "s3cret-dp-token"
REPO = Path(__file__).resolve().parents[1]
SERVING = health_pb2.HealthCheckResponse.SERVING


def self_signed_cert(folder: Path, dns_names: tuple[str, ...] = ("localhost",),
                     ip_addresses: tuple[str, ...] = ("127.0.0.1",)) -> tuple[Path, Path]:
    """A certificate for these names (by default localhost and 127.0.0.1), and its key, as PEM files."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName([*map(x509.DNSName, dns_names),
                                       *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@pytest.fixture(scope="module")
def secure(tiny_qwen3_dir, tmp_path_factory):
    """TLS + API key on the public API (127.0.0.1, a free port); the data plane requires a token.

    The control plane starts before its data plane, so readiness can be watched from NOT_SERVING on.
    """
    from tests.conftest import Planes

    folder = tmp_path_factory.mktemp("secure")
    cert, key = self_signed_cert(folder)
    planes = Planes(folder, tiny_qwen3_dir, ("--block-size", "16", "--max-model-len", "512", "--token", DP_TOKEN),
                    security=Security(str(cert), str(key), API_KEY), listen="127.0.0.1:0", dataplane_token=DP_TOKEN)
    planes.start_controlplane()
    planes.cert = cert.read_bytes()
    planes.health_before_dataplane = _health(planes)
    planes.start_dataplane()
    planes.wait_ready(120)
    yield planes
    planes.stop()


def _health(planes) -> int:
    creds = grpc.ssl_channel_credentials(planes.cert)
    with grpc.secure_channel(planes.address, creds) as channel:  # no API key: health stays open to probes
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _generate(client: Client) -> list[int]:
    return [t for c in client.generate(token_ids=[5, 6, 7], max_tokens=3, **GREEDY) for t in c.token_ids]


def test_health_follows_data_plane_readiness(secure):
    assert secure.health_before_dataplane == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(secure) == SERVING
    with grpc.secure_channel(secure.address, grpc.ssl_channel_credentials(secure.cert)) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:  # a stream held open: only with the key
            next(watch)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_api_key_is_required(secure):
    for key in (None, "wrong", API_KEY + "x", ""):
        with Client(secure.address, root_certificates=secure.cert, api_key=key) as client:
            with pytest.raises(grpc.RpcError) as info:
                _generate(client)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                client.model_info(timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(secure.address, root_certificates=secure.cert, api_key=API_KEY) as client:
        assert len(_generate(client)) == 3


def test_tls_is_required_when_configured(secure):
    with Client(secure.address, api_key=API_KEY) as plaintext:
        with pytest.raises(grpc.RpcError) as info:
            plaintext.model_info(timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(secure.address, root_certificates=secure.cert, api_key=API_KEY) as client:
        assert client.model_info(timeout=10).vocab_size == 49152


def test_data_plane_refuses_a_missing_or_wrong_token(secure):
    with grpc.insecure_channel(secure.dp_address) as channel:
        stub = dp_grpc.DataPlaneStub(channel)
        for metadata in ((), (("x-twinplane-token", "wrong"),), (("x-twinplane-token", DP_TOKEN[:-1]),)):
            for call in (stub.Describe, stub.Reset):
                with pytest.raises(grpc.RpcError) as info:
                    call(dp.DescribeRequest() if call is stub.Describe else dp.ResetRequest(), timeout=10,
                         metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Describe(dp.DescribeRequest(), timeout=10,
                             metadata=(("x-twinplane-token", DP_TOKEN),)).vocab_size == 49152

    async def connect_with_wrong_token() -> None:
        client = DataPlaneClient(secure.dp_address, "wrong")
        try:
            await client.connect(timeout=10)
        finally:
            await client.close()

    with pytest.raises(DataPlaneLost) as info:
        asyncio.run(connect_with_wrong_token())
    assert info.value.fatal and not info.value.not_up and "UNAUTHENTICATED" in str(info.value)


def test_a_data_plane_not_up_yet_is_told_apart_from_one_that_fails(tmp_path):
    """Nothing listening at the address (a data plane still loading its model) is what the control
    plane expects at start-up: it says so at INFO, not as a warning."""
    async def connect(target: str) -> None:
        client = DataPlaneClient(target)
        try:
            await client.connect(timeout=10)
        finally:
            await client.close()

    with socket.socket() as sock:  # a loopback port that nothing listens on, held so that nothing else takes it
        sock.bind(("127.0.0.1", 0))
        for target in (f"unix://{tmp_path}/nobody.sock", f"127.0.0.1:{sock.getsockname()[1]}"):
            with pytest.raises(DataPlaneLost) as info:
                asyncio.run(connect(target))
            assert info.value.not_up and not info.value.fatal, str(info.value)


def test_reflection_lists_the_public_api(shared_planes):
    with grpc.insecure_channel(shared_planes.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"twinplane.v1.Generation", "grpc.health.v1.Health"} <= services
        database = ProtoReflectionDescriptorDatabase(channel)
        assert database.FindFileContainingSymbol("twinplane.v1.Generation").package == "twinplane.v1"


def test_both_planes_report_health(shared_planes):
    for address in (shared_planes.address, shared_planes.dp_address):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == SERVING, address


def test_everything_listens_on_loopback_or_a_unix_socket_by_default():
    assert ControlPlaneConfig(dataplane="x").listen.startswith("127.0.0.1:")
    parser = build_parser()
    assert parser.parse_args(["controlplane"]).listen.startswith("127.0.0.1:")
    assert parser.parse_args(["controlplane"]).dataplane.startswith("127.0.0.1:")
    assert parser.parse_args(["dataplane"]).listen.startswith("127.0.0.1:")
    serve = parser.parse_args(["serve"])
    assert serve.listen.startswith("127.0.0.1:") and serve.dataplane_listen is None  # None: a private unix socket


WIRE_CODE = ["controlplane", "clients", "proto", "dataplane/server.py", "dataplane/convert.py", "dataplane/main.py"]


# Pickles the calls between the control plane's processes, over anonymous socketpairs that only
# the control plane and the children it spawns hold: no address anyone could connect to.
PRIVATE_IPC = "controlplane/ipc.py"


def test_nothing_on_the_wire_is_pickled():
    """The planes and clients speak protobuf only: no pickle-like module is imported on the wire path."""
    files = [p for entry in WIRE_CODE for p in ((REPO / entry).rglob("*.py") if (REPO / entry).is_dir()
                                                 else [REPO / entry])]
    assert len(files) > 15
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill|marshal|shelve)\b", re.M)
    offenders = [str(p.relative_to(REPO)) for p in files if pattern.search(p.read_text())]
    assert offenders == [PRIVATE_IPC]


def test_the_pickled_channels_are_private_socketpairs():
    """The pickled channels never listen or connect to an address: their sockets come from
    socket.socketpair() in the control plane; a child gets its end at spawn, or (a secondary
    frontend) over its own control socketpair, as a passed file descriptor."""
    ipc = (REPO / PRIVATE_IPC).read_text()
    assert not re.search(r"\.(bind|listen|connect|accept)\(|start_server|open_unix_connection", ipc)
    sources = [p for folder in ("controlplane", "dataplane", "clients", "kernels")
               for p in (REPO / folder).rglob("*.py")]
    users = {p.name: p.read_text() for p in sources if re.search(r"\b(Channel|Control)\(", p.read_text())
             and p.name != "ipc.py"}
    assert sorted(users) == ["engine_core.py", "frontends.py", "supervisor.py"]
    assert re.findall(r"\b(?:Channel|Control)\((\w+)\)", users["engine_core.py"]) == ["sock"]  # inherited fds
    assert "pairs = [socket.socketpair() for _ in range(config.api_server_count)]" in users["engine_core.py"]
    assert re.findall(r"\b(?:Channel|Control)\((\w+)\)", users["supervisor.py"]) == ["sock"]  # from those pairs
    assert re.findall(r"\b(?:Channel|Control)\((\w+)\)", users["frontends.py"]) == ["primary_end", "sock"]  # its pair
    pair = "primary_end, secondary_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)"
    assert pair in users["frontends.py"]
    assert not re.search(r"\.(bind|listen|connect|accept)\(", users["frontends.py"] + users["supervisor.py"])


def test_jinja2_without_the_sandbox_breakout_is_required():
    """Chat templates run in jinja2's sandbox, which 3.1.5 and older let a template leave."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    jinja2, = (r for r in map(Requirement, dependencies) if r.name.lower() == "jinja2")
    assert not jinja2.specifier.contains("3.1.5") and jinja2.specifier.contains("3.1.6")
    assert jinja2.specifier.contains(importlib.metadata.version("jinja2"))
