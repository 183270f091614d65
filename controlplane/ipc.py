"""Messages between the control plane's processes: the engine core and its frontends over one
socket each (``Channel``), and the primary frontend and each secondary (``Control``).

A message is one of the typed objects of ``messages.py``, pickled and length-prefixed. Messages
are one-way (nothing is awaited), so neither side ever blocks on the other: writes go into the
event loop's buffer, and ``serve`` hands the messages that arrive, in order, to the receiver's
dispatch on their type. Both ends are processes of one control plane connected by a socketpair,
so pickle never reads bytes from anyone else.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable

_LENGTH = struct.Struct("<I")
MAX_CONTROL_BYTES = 1 << 18  # a Control message: a configuration, or a frontend's metrics


# The signals that stop a process in order: Ctrl-C, kill (systemd's too) and a closed terminal or ssh
# session. A child that its parent stops in order ignores them: one sent to the whole process group
# (Ctrl-C in a terminal; systemd signals every process of the service) reaches the parent too, which
# needs its children while it drains, then stops them itself.
GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
# In the environment of a data plane that `twinplane serve` or `run` started: it ignores GROUP_SIGNALS
# and stops when its stdin closes (the parent closes it to stop it, or exits).
SUPERVISED_ENV = "TWINPLANE_SUPERVISED"
CONFIG_ERROR_EXIT = 78  # EX_CONFIG: a process refused its flags or files; starting it again would not help


class ConfigExit(SystemExit):
    """A command that refuses its flags or files: its one-line message (str) on stderr, which the
    `twinplane` command writes, and exit code CONFIG_ERROR_EXIT."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = CONFIG_ERROR_EXIT


def child_exited(message: str, returncode: int) -> SystemExit:
    """The exit of a command whose child (a server it started) exited with returncode: CONFIG_ERROR_EXIT
    passed on (the child refused its flags: starting it again would not help), 1 for anything else."""
    return ConfigExit(message) if returncode == CONFIG_ERROR_EXIT else SystemExit(message)


def popen_shielded(argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs) for a child that calls ignore_group_signals: it starts with
    GROUP_SIGNALS blocked (a signal mask survives fork and exec), so one that reaches the process
    group while it is still starting Python and importing stays pending until it ignores them."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignore_group_signals() -> None:
    """In a child of popen_shielded: GROUP_SIGNALS ignored from now on (the pending ones discarded)."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


def start_process(module: str, args: list[str], fds: list[int]) -> subprocess.Popen:
    """Runs ``module.main()`` in a child process of this control plane (shielded from the process
    group's signals: the parent shuts its children down in order), with argv args plus the log
    level, inheriting fds."""
    return popen_shielded([sys.executable, "-c", f"from {module} import main; main()", *args,
                           str(logging.getLogger().level)], pass_fds=fds, stdin=subprocess.DEVNULL)


def child_argv() -> tuple[list[str], int]:
    """In a child of start_process: the process group's signals ignored from now on, logging set up;
    returns its args and log level."""
    ignore_group_signals()
    args, log_level = sys.argv[1:-1], int(sys.argv[-1])
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args, log_level


def encode(message) -> bytes:
    """message as a channel sends it (encode once to send it on several channels)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


class Channel:
    """One end of a socketpair as a stream of messages."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.num_received = 0  # messages received so far: a count that moves while the other end is alive

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(sock=self.sock)

    def send(self, message) -> None:
        """Sends message to the other end, without waiting; dropped unless the channel is open."""
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Sends a message made by encode(); dropped unless the channel is open."""
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(data)

    async def receive(self):
        """The next message that arrives; None once the other end has closed."""
        try:
            header = await self.reader.readexactly(_LENGTH.size)
            payload = await self.reader.readexactly(_LENGTH.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        self.num_received += 1
        return pickle.loads(payload)

    async def serve(self, dispatch: Callable[[object], None], turn_each: bool = False) -> None:
        """Hands each message that arrives to dispatch; returns when the other end closes.

        turn_each: the event loop gets a turn after each message. Messages already buffered (a
        backlog from a time the loop was busy) are otherwise applied in one go, which suits the
        engine core (it plans with all of them), but not a frontend: the work they wake (a stream
        sending its queued tokens) would wait for the whole backlog, and the frontend would take
        its own delay for a client that does not read.
        """
        while (message := await self.receive()) is not None:
            dispatch(message)
            if turn_each:
                await asyncio.sleep(0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        else:
            self.sock.close()


class Control:
    """One end of a SOCK_SEQPACKET socketpair between two frontends of one control plane: pickled
    messages, each with file descriptors (SCM_RIGHTS) or none."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.inbox: asyncio.Queue = asyncio.Queue()  # (message, fds); None once the other end closed
        self._listening = False

    def start_reading(self) -> None:
        """Starts queueing what arrives (call on the event loop)."""
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)
        self._listening = True

    def _readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_CONTROL_BYTES, 4)
        except BlockingIOError:
            return
        except OSError:
            data, fds = b"", []
        if not data:
            self._stop_listening()
            self.inbox.put_nowait(None)
            return
        self.inbox.put_nowait((pickle.loads(data), fds))

    def send(self, message, fds: list[int] = ()) -> bool:
        """Sends message (and fds); False when the other end is gone."""
        try:
            socket.send_fds(self.sock, [pickle.dumps(message, pickle.HIGHEST_PROTOCOL)], list(fds))
            return True
        except OSError:
            return False

    def _stop_listening(self) -> None:
        if self._listening:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self._listening = False

    def close(self) -> None:
        self._stop_listening()
        self.sock.close()
