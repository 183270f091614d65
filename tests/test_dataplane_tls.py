"""TLS between the planes: a data plane served over TLS on a loopback TCP port, control planes that
verify it (the same greedy tokens as without TLS), and those that cannot (no CA, the wrong CA, the
wrong name), which say why in their log, keep retrying and stay up. The token is still required."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Planes
from tests.reliability import GREEDY, StderrLog, stop_process, wait_until
from tests.test_reliability_security import self_signed_cert
from twinplane.controlplane.dataplane_client import DataPlaneClient, DataPlaneLost
from twinplane.controlplane.tls import DataPlaneTls, server_credentials
from twinplane.dataplane.server import create_server
from twinplane.proto import dataplane_pb2 as dp
from twinplane.proto import dataplane_pb2_grpc as dp_grpc

TOKEN = "t0ken-over-tls"
SERVICE_NAME = "twinplane-dataplane"  # what the data plane's certificate names, as in deploy/kubernetes
SMALL = ("--block-size", "16", "--max-model-len", "512")  # as shared_planes, the plaintext reference
PROMPTS = ([5, 6, 7], [100, 200, 300, 400, 500])


def _health(address: str, credentials: grpc.ChannelCredentials | None = None, options=()) -> str:
    channel = (grpc.secure_channel(address, credentials, options=list(options)) if credentials
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.fixture(scope="module")
def tls_dataplane(tiny_qwen3_dir, tmp_path_factory):
    """A tiny data plane on 127.0.0.1 over TLS, its certificate issued to SERVICE_NAME only, requiring
    TOKEN; its health also in plaintext on a port of its own. Also: another CA's certificate."""
    folder = tmp_path_factory.mktemp("tls")
    (folder / "other").mkdir()
    cert, key = self_signed_cert(folder, dns_names=(SERVICE_NAME,), ip_addresses=())
    other_ca, _ = self_signed_cert(folder / "other")
    log = folder / "dataplane.log"
    with open(log, "wb") as stderr:  # any free ports, as its ready line names them
        process = subprocess.Popen([sys.executable, "-m", "twinplane.clients.cli", "dataplane", "--model",
                                    str(tiny_qwen3_dir), "--device", "cpu", *SMALL, "--listen", "127.0.0.1:0",
                                    "--token", TOKEN, "--tls-cert", str(cert), "--tls-key", str(key),
                                    "--health-listen", "127.0.0.1:0"], stdin=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_until(lambda: "data plane ready on" in log.read_text() or process.poll() is not None, 120,
                   "the data plane's ready line", poll=0.2)
        assert process.poll() is None, "the data plane exited"
        address, health_address = re.search(r"ready on (127\.0\.0\.1:\d+) \(TLS\), health on (127\.0\.0\.1:\d+):",
                                            log.read_text()).groups()
        wait_until(lambda: _health(health_address) == "SERVING", 30, "the data plane's plaintext health", poll=0.2)
        yield dict(address=address, health_address=health_address, ca=str(cert), other_ca=str(other_ca),
                   folder=folder, log=log)
    finally:
        stop_process(process)


def _control_plane(tmp_path, model, dataplane: dict, tls: DataPlaneTls, token: str = TOKEN) -> Planes:
    planes = Planes(tmp_path, model, dp_address=dataplane["address"], dataplane_token=token, dataplane_tls=tls)
    planes.start_controlplane()
    return planes


def _tokens(planes) -> list[list[int]]:
    with planes.client() as client:
        return [[t for c in client.generate(token_ids=p, max_tokens=8, **GREEDY) for t in c.token_ids]
                for p in PROMPTS]


def test_a_control_plane_with_the_ca_streams_the_same_tokens_as_without_tls(tls_dataplane, tiny_qwen3_dir,
                                                                           shared_planes, tmp_path):
    planes = _control_plane(tmp_path, tiny_qwen3_dir, tls_dataplane,
                            DataPlaneTls(ca=tls_dataplane["ca"], server_name=SERVICE_NAME))
    try:
        planes.wait_ready(60)
        assert _tokens(planes) == _tokens(shared_planes)  # shared_planes: a plaintext unix socket
    finally:
        planes.stop()


@pytest.mark.parametrize("case", ["no CA", "wrong CA", "wrong name"])
def test_a_control_plane_that_cannot_verify_the_data_plane_says_why_and_keeps_trying(
        case, tls_dataplane, tiny_qwen3_dir, tmp_path, capfd):
    tls, why = {
        "no CA": (DataPlaneTls(), "if the data plane serves TLS, give --dataplane-tls-ca"),
        "wrong CA": (DataPlaneTls(ca=tls_dataplane["other_ca"], server_name=SERVICE_NAME),
                     "CERTIFICATE_VERIFY_FAILED"),
        # the certificate names SERVICE_NAME, not 127.0.0.1
        "wrong name": (DataPlaneTls(ca=tls_dataplane["ca"]),
                       "give the name it carries with --dataplane-tls-server-name"),
    }[case]
    planes = _control_plane(tmp_path, tiny_qwen3_dir, tls_dataplane, tls)
    try:
        stderr = StderrLog(capfd)
        log = stderr.wait_for("cannot be reached, retrying every", why)
        assert tls_dataplane["address"] in log and "Traceback" not in log
        time.sleep(1.5)  # a few more attempts: said once, and nothing gives up
        assert "cannot be reached" not in stderr.read()
        with planes.client() as client:
            assert client.health_status(5) == "NOT_SERVING"  # up, and honest about it
        assert not planes.engine.crashed.is_set()
    finally:
        planes.stop()


def test_the_token_is_still_required_over_tls(tls_dataplane):
    creds = DataPlaneTls(ca=tls_dataplane["ca"], server_name=SERVICE_NAME)
    options = creds.options()
    with grpc.secure_channel(tls_dataplane["address"], creds.credentials(), options=options) as channel:
        stub = dp_grpc.DataPlaneStub(channel)
        for metadata in ((), (("x-twinplane-token", "wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Describe(dp.DescribeRequest(), timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Describe(dp.DescribeRequest(), timeout=10, metadata=(("x-twinplane-token", TOKEN),))
        assert reply.vocab_size == 49152

    async def connect(token: str) -> None:
        client = DataPlaneClient(tls_dataplane["address"], token, tls=creds)
        try:
            await client.connect(timeout=10)
        finally:
            await client.close()

    with pytest.raises(DataPlaneLost) as info:
        asyncio.run(connect("wrong"))
    assert info.value.fatal and "UNAUTHENTICATED" in str(info.value)


def test_health_is_in_plaintext_only_on_the_health_port(tls_dataplane):
    assert _health(tls_dataplane["health_address"]) == "SERVING"
    assert _health(tls_dataplane["address"]) == "UNAVAILABLE"  # the TLS port speaks no plaintext
    creds = DataPlaneTls(ca=tls_dataplane["ca"], server_name=SERVICE_NAME)
    assert _health(tls_dataplane["address"], creds.credentials(), creds.options()) == "SERVING"
    with grpc.insecure_channel(tls_dataplane["health_address"]) as channel:  # and nothing else there
        with pytest.raises(grpc.RpcError) as info:
            dp_grpc.DataPlaneStub(channel).Describe(dp.DescribeRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_connections_to_the_tls_port_write_no_log_lines(tls_dataplane):
    """Any client that reaches a TLS port can fail handshakes in a loop: gRPC's own line for each (outside
    the service's log format) stays out of the log."""
    host, port = tls_dataplane["address"].rsplit(":", 1)
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            try:
                while sock.recv(1 << 10):
                    pass
            except OSError:
                pass
    assert _health(tls_dataplane["health_address"]) == "SERVING"  # it went on serving
    time.sleep(0.5)
    log = tls_dataplane["log"].read_text(errors="replace")
    assert "data plane ready" in log and "andshake" not in log and "ssl_transport_security" not in log, log[-3000:]


def test_mutual_tls_admits_only_a_client_with_a_certificate_the_data_plane_trusts(tmp_path):
    for name in ("server", "client", "stranger"):
        (tmp_path / name).mkdir()
    server_cert, server_key = self_signed_cert(tmp_path / "server")
    client_cert, client_key = self_signed_cert(tmp_path / "client")
    stranger_cert, stranger_key = self_signed_cert(tmp_path / "stranger")
    credentials = server_credentials(str(server_cert), str(server_key), str(client_cert))
    server, port, _ = create_server(None, "127.0.0.1:0", TOKEN, credentials=credentials)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        outcomes = {}
        for name, cert, key in (("none", None, None), ("stranger", stranger_cert, stranger_key),
                                ("client", client_cert, client_key)):
            tls = DataPlaneTls(ca=str(server_cert), cert=cert and str(cert), key=key and str(key))
            outcomes[name] = _health(address, tls.credentials())
        assert outcomes == {"none": "UNAVAILABLE", "stranger": "UNAVAILABLE", "client": "SERVING"}
    finally:
        server.stop(0)


def test_unix_socket_data_planes_stay_plaintext_with_a_ca(tls_dataplane):
    """serve's children listen on private unix sockets: a CA given for TCP data planes leaves them alone."""
    tls = DataPlaneTls(ca=tls_dataplane["ca"])
    assert DataPlaneClient("unix:///run/twinplane/dp.sock", tls=tls).credentials is None
    assert DataPlaneClient(tls_dataplane["address"], tls=tls).credentials is not None


def test_unusable_tls_files_stop_either_plane_at_start_with_one_line_naming_the_flag(tmp_path):
    from twinplane.clients.cli import _controlplane, _dataplane_tls, build_parser

    (tmp_path / "other").mkdir()
    cert, key = self_signed_cert(tmp_path)
    _, other_key = self_signed_cert(tmp_path / "other")
    result = subprocess.run([sys.executable, "-m", "twinplane.clients.cli", "dataplane", "--model", "dummy:tiny-qwen3",
                             "--device", "cpu", "--insecure", "--tls-cert", str(cert), "--tls-key", str(other_key)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 78 and result.stderr.count("\n") == 1, result.stderr  # EX_CONFIG
    assert "--tls-key" in result.stderr and "do not make a key pair" in result.stderr

    def controlplane_error(*argv: str) -> str:
        args = build_parser().parse_args(["controlplane", *argv])
        with pytest.raises(SystemExit) as info:
            _controlplane(args, args.dataplane, None, _dataplane_tls(args))
        return str(info.value)

    assert controlplane_error("--dataplane-tls-ca", str(tmp_path / "none.pem")) == \
        f"twinplane controlplane: --dataplane-tls-ca {tmp_path / 'none.pem'}: No such file or directory"
    assert "--dataplane-tls-ca" in controlplane_error("--dataplane-tls-ca", str(key))  # a key, no certificate
    assert controlplane_error("--dataplane-tls-server-name", "x").startswith(
        "twinplane controlplane: --dataplane-tls-server-name needs --dataplane-tls-ca")
