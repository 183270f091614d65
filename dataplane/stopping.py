"""When a data plane stops.

Run on its own, on SIGTERM, SIGINT or SIGHUP: a signal while it loads ends it at once (a model half
loaded has nothing to finish), one while it serves stops it in order. Started by `twinplane serve` or
`run` (SUPERVISED_ENV in its environment), it ignores those signals, which reach its parent too
when they are sent to the whole process group (Ctrl-C, systemd stopping the service) and the
parent needs its data plane while its streams drain; it stops when its stdin closes instead,
which the parent does to stop it, and which its exit does too.
"""

from __future__ import annotations

import os
import signal
import threading

from twinplane.controlplane.ipc import GROUP_SIGNALS, SUPERVISED_ENV, ignore_group_signals


class Stop:
    """Create it first thing; ``wait()`` once serving."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.serving = False
        self.supervised = os.environ.get(SUPERVISED_ENV) == "1"
        if self.supervised:
            ignore_group_signals()
            threading.Thread(target=self._watch_stdin, daemon=True, name="twinplane-parent").start()
        else:  # while it loads: Ctrl-C or a closed terminal ends it quietly, not with a traceback
            for sig in (signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._request)

    def _watch_stdin(self) -> None:
        # the file descriptor, not sys.stdin: a daemon thread blocked in a buffered read holds its
        # lock, which the interpreter's shutdown then cannot take (a fatal error at exit)
        while os.read(0, 4096):  # b"" at end of file
            pass
        self._request()

    def _request(self, *_) -> None:
        if not self.serving:
            os._exit(0)  # tensor-parallel workers see rank 0 gone and exit too
        self.requested.set()

    def wait(self) -> None:
        """Serving from now on: returns once a stop is requested."""
        self.serving = True
        if not self.supervised:
            for sig in GROUP_SIGNALS:
                signal.signal(sig, self._request)
        # in steps: a signal that the kernel hands to another thread (gRPC's) only marks the handler due, and
        # the main thread runs it at its next bytecode, which an endless wait would never reach
        while not self.requested.wait(0.2):
            pass
