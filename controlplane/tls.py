"""TLS files as gRPC credentials, read and checked at start-up: a missing, unreadable or mismatched
file is a one-line error that names its flag, never a handshake that fails later.

The control plane uses them for its public API (``--tls-cert``/``--tls-key``) and for its channels
to data planes on TCP (``DataPlaneTls``); the command line builds the data plane's server
credentials (``--tls-cert``/``--tls-key``/``--tls-client-ca`` of ``twinplane dataplane``) here too.
The addresses the servers listen on are checked here as well (``check_listen``, ``parse_listen``).
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass

import grpc

DEFAULT_HOST = "127.0.0.1"  # the HTTP API's host when --http-listen gives only a port


def read_pem(path: str, flag: str) -> bytes:
    """The PEM file at path, or ValueError naming the flag that gave it."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


def _check_key_pair(cert: str, key: str, flags: tuple[str, str]) -> None:
    """That key is the private key of cert's first certificate (what a handshake would find)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"{flags[0]} {cert} and {flags[1]} {key} do not make a key pair: "
                         f"{exc.reason or exc}") from None


def _check_roots(pem: bytes, flag: str, path: str) -> None:
    try:
        ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
    except ssl.SSLError as exc:
        raise ValueError(f"{flag} {path}: no usable certificate: {exc.reason or exc}") from None


def key_pair(cert: str | None, key: str | None, flags: tuple[str, str]) -> tuple[bytes, bytes] | None:
    """(key, certificate chain) as PEM bytes, both checked; None when neither file is given."""
    if not (cert or key):
        return None
    if not (cert and key):
        raise ValueError(f"{flags[0]} and {flags[1]} go together")
    pair = read_pem(key, flags[1]), read_pem(cert, flags[0])
    _check_key_pair(cert, key, flags)
    return pair


def roots(path: str | None, flag: str) -> bytes | None:
    """The CA certificates in path as PEM bytes, checked; None without a path."""
    if path is None:
        return None
    pem = read_pem(path, flag)
    _check_roots(pem, flag, path)
    return pem


def server_credentials(cert: str | None, key: str | None, client_ca: str | None = None,
                       flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca"),
                       ) -> grpc.ServerCredentials | None:
    """TLS with this certificate and key (None without them); with client_ca, clients must present
    a certificate it signed (mutual TLS)."""
    pair = key_pair(cert, key, flags[:2])
    if pair is None:
        if client_ca:
            raise ValueError(f"{flags[2]} needs {flags[0]} and {flags[1]}")
        return None
    client_roots = roots(client_ca, flags[2])
    return grpc.ssl_server_credentials([pair], root_certificates=client_roots,
                                       require_client_auth=client_roots is not None)


def is_unix(target: str) -> bool:
    return target.startswith("unix:")


def unix_path(target: str) -> str:
    """The socket path of a unix: address as gRPC reads it: unix:path (relative or absolute) and
    unix://absolute_path, where unix://name is /name."""
    path = target.removeprefix("unix:")
    return "/" + path[2:].lstrip("/") if path.startswith("//") else path


def _answered(path: str) -> bool:
    """Whether a server accepts connections on the unix socket at path."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:  # no such file, not a socket, or a socket left behind by a server that is gone
            return False
    return True


def is_loopback(address: str) -> bool:
    """Whether a gRPC host:port (or unix:) address stays on this machine."""
    if is_unix(address):
        return True
    host = address.rpartition(":")[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and int(text) <= 65535


_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")  # gRPC targets that name their kind


def _bad_address(address: str, flag: str) -> ValueError:
    return ValueError(f"{flag} must be host:port with a port in [0, 65535], or unix:///path; got {address!r}")


def check_target(target: str, flag: str = "--dataplane") -> str:
    """target unless a channel to it could not be what was meant: none at all, no socket path, a host with
    spaces (a socket path may hold them: a TMPDIR with one), or a port past 65535 (gRPC would take 99999
    modulo 65536); else ValueError naming the flag."""
    if not target:
        bad = True
    elif is_unix(target):
        bad = not unix_path(target).strip("/")
    else:
        port = target.rpartition(":")[2]
        bad = any(c.isspace() for c in target) or not target.startswith(_SCHEMES) and port.isdigit() and not (
            _is_port(port))
    if bad:
        raise _bad_address(target, flag)
    return target


def check_listen(address: str, flag: str = "--listen") -> str:
    """address if a server can be asked to listen there (host:port with a port in [0, 65535], or
    unix:///path to a socket in a folder that exists), else ValueError naming the flag: gRPC would take
    port 65536 for port 0, and a socket path it cannot bind would fail as a busy port would, though
    waiting would not free it."""
    if not (unix_path(address).strip("/") if is_unix(address) else _is_port(address.rpartition(":")[2])):
        raise _bad_address(address, flag)
    if is_unix(address):
        path = unix_path(address)
        if os.path.isdir(path):
            raise ValueError(f"{flag} {address}: {path} is a folder; name a socket file in it, e.g. "
                             f"unix://{os.path.join(os.path.abspath(path), 'api.sock')}")
        folder = os.path.dirname(path)
        if folder and not os.path.isdir(folder):
            raise ValueError(f"{flag} {address}: the folder {folder} does not exist")
    return address


def every_address(host: str) -> str:
    """The host an HTTP server binds for host: '::' (every address, IPv6 and IPv4 alike, as gRPC's
    '[::]') is '0.0.0.0' on a host without IPv6; any other host is itself."""
    if host != "::":
        return host
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return "0.0.0.0"
    return host


def parse_listen(listen: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or a bare port (loopback): where the HTTP API listens."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_HOST
    if not _is_port(port):
        raise ValueError(f"--http-listen must be host:port or a port, got {listen!r}")
    return host or DEFAULT_HOST, int(port)


def add_port(server, listen: str, credentials: grpc.ServerCredentials | None = None, flag: str = "--listen") -> int:
    """Binds a gRPC server (grpc.Server or grpc.aio.Server) to listen; returns the port, or raises
    OSError naming the flag when it cannot bind there. gRPC would take over a unix socket another
    server still listens on (that server then unreachable): such a path is refused as in use."""
    if is_unix(listen) and _answered(unix_path(listen)):
        raise OSError(f"{flag} {listen}: another server listens there already")
    try:
        return server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    except RuntimeError:  # gRPC says only "Failed to bind to address"
        raise OSError(f"{flag} {listen}: cannot listen there (the port is in use, or the address or its "
                      "folder is not this host's)") from None


def bound_address(listen: str, port: int) -> str:
    """listen as a server bound it (port: what add_port returned): a TCP address with the port the OS
    chose where it asked for any free one (port 0); a unix socket as it is."""
    return listen if is_unix(listen) else f"{listen.rpartition(':')[0]}:{port}"


# The control plane's flags for each field of DataPlaneTls, as its errors name them.
DATAPLANE_TLS_FLAGS = {"ca": "--dataplane-tls-ca", "server_name": "--dataplane-tls-server-name",
                       "cert": "--dataplane-tls-cert", "key": "--dataplane-tls-key"}


@dataclass(frozen=True)
class DataPlaneTls:
    """How the control plane secures its channels to data planes on TCP (unix sockets stay plaintext).

    TLS is on with ``ca`` (PEM roots that verify the data planes' certificates) or ``default_roots``
    (gRPC's bundled public roots); ``server_name`` is the name certificates must carry when it is not
    the host of the address (one certificate for a Service's name); ``cert``/``key`` are the control
    plane's own certificate, for data planes that require one (mutual TLS).
    """

    ca: str | None = None
    default_roots: bool = False
    server_name: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.default_roots

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials for TCP data planes (None: plaintext), from files read and checked now."""
        flags = DATAPLANE_TLS_FLAGS
        if not self.enabled:
            extra = [flags[name] for name in ("server_name", "cert", "key") if getattr(self, name)]
            if extra:
                raise ValueError(f"{', '.join(extra)} {'needs' if len(extra) == 1 else 'need'} {flags['ca']} "
                                 "(or --dataplane-tls for the default roots)")
            return None
        pair = key_pair(self.cert, self.key, (flags["cert"], flags["key"]))
        private_key, chain = pair if pair is not None else (None, None)
        return grpc.ssl_channel_credentials(roots(self.ca, flags["ca"]), private_key, chain)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.enabled and self.server_name else []
