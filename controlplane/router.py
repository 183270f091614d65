"""Which data plane a new sequence goes to, when the engine core drives several.

``prefix`` (the default) sends a sequence to the data plane that was given the longest run of
its leading blocks before, so requests that share a system prompt or a conversation share one
KV cache and its prefix hits. A sequence whose data plane is full (as many sequences as
max_num_seqs) goes to the least loaded one with room; one whose prefix is new, or whose data
plane is much busier than the least loaded one, to the least loaded. The router remembers routes by
the same chained block hashes the BlockManager uses, in a bounded table (least recently used
routes are forgotten first). ``least-loaded`` and ``round-robin`` ignore prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from twinplane.controlplane.block_manager import chain_hash
from twinplane.controlplane.sequence import Sequence

if TYPE_CHECKING:
    from twinplane.controlplane.replica import Replica

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
BALANCE_SLACK = 32  # sequences a prefix's data plane may have above the least loaded one and still get it
MAX_ROUTES = 1 << 20  # block hashes remembered (about 100 MiB at most)


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks a prefix-cache lookup would try (the last token is never cached)."""
    hashes, prefix_hash = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        prefix_hash = chain_hash(token_ids[start:start + block_size], prefix_hash)
        hashes.append(prefix_hash)
    return hashes


class Router:
    def __init__(self, policy: str = "prefix", max_routes: int = MAX_ROUTES):
        assert policy in ROUTING_POLICIES, f"unknown routing policy {policy!r}"
        self.policy = policy
        self.max_routes = max_routes
        self.routes: OrderedDict[int, int] = OrderedDict()  # block hash -> replica index, oldest first
        self._turn = 0

    def pick(self, seq: Sequence, replicas: list[Replica]) -> Replica:
        """The replica among replicas (connected, able to hold seq) that gets seq."""
        if self.policy == "round-robin":
            self._turn += 1
            return replicas[self._turn % len(replicas)]
        least = min(replicas, key=lambda r: r.load)
        if self.policy == "least-loaded":
            return least
        hashes = prompt_block_hashes(seq.token_ids, replicas[0].describe.block_size)
        holder = self._holder(hashes, replicas)
        if holder is None or holder.load - least.load > BALANCE_SLACK:
            choice = least
        elif holder.has_room:
            choice = holder
        else:  # full: the least loaded replica with room, if any has
            choice = min((r for r in replicas if r.has_room), key=lambda r: r.load, default=holder)
        self._remember(hashes, choice.index)
        return choice

    def forget(self, index: int) -> None:
        """A data plane lost its KV cache: its routes no longer lead to cached blocks."""
        self.routes = OrderedDict((h, i) for h, i in self.routes.items() if i != index)

    def _holder(self, hashes: list[int], replicas: list[Replica]) -> Replica | None:
        """The replica given the longest prefix of these blocks (a chained hash stands for its whole prefix)."""
        by_index = {r.index: r for r in replicas}
        for h in reversed(hashes):
            replica = by_index.get(self.routes.get(h))
            if replica is not None:
                return replica
        return None

    def _remember(self, hashes: list[int], index: int) -> None:
        routes = self.routes
        for h in hashes:
            routes[h] = index
            routes.move_to_end(h)
        while len(routes) > self.max_routes:
            routes.popitem(last=False)
