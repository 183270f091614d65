"""The engine core's side of several frontends: who owns a sequence, and what each frontend hears.

With ``api_server_count`` N, frontend i numbers its sequences i + N, i + 2N, ..., so a
sequence's owner is its id modulo N (with one frontend, every id is frontend 0's). A step's
tokens, a failed step and a refusal go to the owners of the sequences in them, each with the
core's snapshot; every other call (connected, lost, stalled, snapshot, heartbeat) goes to all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from twinplane.controlplane.ipc import Channel, encode


def seq_ids(index: int, count: int) -> Iterator[int]:
    """The sequence ids frontend index (of count) gives its requests: all distinct across frontends."""
    return itertools.count(count + index, count)


def owner(seq_id: int, count: int) -> int:
    """The index of the frontend that numbered seq_id."""
    return seq_id % count


class Frontends:
    """FRONTEND_CALLS on every frontend's channel, each call sent where it belongs."""

    def __init__(self, channels: list[Channel]):
        self.channels = channels

    def _split(self, items: list, seq_id_of) -> list[list]:
        count = len(self.channels)
        parts = [[] for _ in range(count)]
        for item in items:
            parts[owner(seq_id_of(item), count)].append(item)
        return parts

    def _broadcast(self, name: str, *args) -> None:
        message = encode(name, *args)
        for channel in self.channels:
            channel.send(message)

    def step(self, outputs: list[tuple], snapshot) -> None:
        """Each frontend gets its sequences' tokens with the snapshot, or the snapshot alone."""
        if len(self.channels) == 1:
            self.channels[0].call("step", outputs, snapshot)
            return
        for channel, part in zip(self.channels, self._split(outputs, lambda output: output[0])):
            if part:
                channel.call("step", part, snapshot)
            else:
                channel.call("snapshot", snapshot)

    def step_failed(self, seq_ids: list[int], error: str) -> None:
        for channel, part in zip(self.channels, self._split(seq_ids, lambda seq_id: seq_id)):
            if part:
                channel.call("step_failed", part, error)

    def refused(self, reasons: list[tuple[int, str]]) -> None:
        for channel, part in zip(self.channels, self._split(reasons, lambda reason: reason[0])):
            if part:
                channel.call("refused", part)

    def connected(self, desc, snapshot) -> None:
        self._broadcast("connected", desc, snapshot)

    def lost(self) -> None:
        self._broadcast("lost")

    def stalled(self, stalled: bool) -> None:
        self._broadcast("stalled", stalled)

    def snapshot(self, snapshot) -> None:
        self._broadcast("snapshot", snapshot)

    def heartbeat(self) -> None:
        self._broadcast("heartbeat")
