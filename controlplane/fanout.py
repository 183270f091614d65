"""The engine core's side of several frontends: who owns a sequence, and what each frontend hears.

With ``api_server_count`` N, frontend i numbers its sequences i + N, i + 2N, ..., so a
sequence's owner is its id modulo N (with one frontend, every id is frontend 0's). A step's
tokens (StepOutputs, with the core's snapshot), a failed step and a refusal go to the owners of
the sequences in them (a frontend with no tokens in a step gets the Snapshot alone); every other
message (Connected, Lost, Stalled, Snapshot, Heartbeat) goes to all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from twinplane.controlplane.ipc import Channel, encode
from twinplane.controlplane.messages import (CoreSnapshot, FrontendMessage, Refused, Rejected, Snapshot,
                                             StepFailed, StepOutputs, TokenOutput)


def seq_ids(index: int, count: int) -> Iterator[int]:
    """The sequence ids frontend index (of count) gives its requests: all distinct across frontends."""
    return itertools.count(count + index, count)


def owner(seq_id: int, count: int) -> int:
    """The index of the frontend that numbered seq_id."""
    return seq_id % count


class Frontends:
    """The core's messages to the frontends, each sent where it belongs."""

    def __init__(self, channels: list[Channel]):
        self.channels = channels

    def send(self, message: FrontendMessage) -> None:
        match message:
            case StepOutputs(outputs, snapshot):
                self._step(outputs, snapshot)
            case StepFailed(seq_ids, error):
                for channel, part in zip(self.channels, self._split(seq_ids, lambda seq_id: seq_id)):
                    if part:
                        channel.send(StepFailed(part, error))
            case Refused(reasons):
                for channel, part in zip(self.channels, self._split(reasons, lambda reason: reason[0])):
                    if part:
                        channel.send(Refused(part))
            case Rejected(seq_id, _):
                self.channels[owner(seq_id, len(self.channels))].send(message)
            case _:
                data = encode(message)
                for channel in self.channels:
                    channel.send_encoded(data)

    def _split(self, items: list, seq_id_of) -> list[list]:
        count = len(self.channels)
        parts = [[] for _ in range(count)]
        for item in items:
            parts[owner(seq_id_of(item), count)].append(item)
        return parts

    def _step(self, outputs: list[TokenOutput], snapshot: CoreSnapshot) -> None:
        """Each frontend gets its sequences' tokens with the snapshot, or the snapshot alone."""
        if len(self.channels) == 1:
            self.channels[0].send(StepOutputs(outputs, snapshot))
            return
        for channel, part in zip(self.channels, self._split(outputs, lambda output: output.seq_id)):
            channel.send(StepOutputs(part, snapshot) if part else Snapshot(snapshot))
