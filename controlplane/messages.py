"""Every message that crosses between the control plane's processes, and what each carries.

Frontend -> engine core (``ipc.Channel``): Configure (first, from frontend 0 only), AddRequest,
Abort, Shutdown. Engine core -> frontends: Connected, Lost, Stalled, StepOutputs, StepFailed,
Refused, Rejected, Snapshot, Heartbeat (``fanout.py`` says which frontend gets which). Primary frontend <->
secondary frontends (``ipc.Control``): StartFrontend, NewCore, StopFrontend one way,
FrontendMetrics the other. Each side dispatches on the message's type; nothing is looked up by name.

All of them are pickled, and only ever between processes of one control plane (``ipc.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from twinplane.controlplane.metrics import STEP_BUCKETS, Histogram

if TYPE_CHECKING:
    from twinplane.controlplane.api import TokenLogprobs
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.metrics import EngineMetrics
    from twinplane.controlplane.sequence import RequestParams
    from twinplane.proto import dataplane_pb2 as dp


# ---- what the messages carry ------------------------------------------------------------------


class TokenOutput(NamedTuple):
    """One sampled token as the frontend gets it (one per generated token: a plain tuple underneath)."""

    seq_id: int
    token_id: int
    position: int  # in the sequence, prompt included
    logprobs: TokenLogprobs | None
    finish_reason: str | None  # FinishReason's value, when a token rule ended the sequence here
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    # with the first output token of a request that wants them: the prompt's, entry i token i's (0: None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    scheduled_time: float | None = None  # with the first output token: Sequence.scheduled_time


_token_output = partial(tuple.__new__, TokenOutput)  # TokenOutput from a plain tuple, without per-field checks


@dataclass
class DataPlaneSnapshot:
    """One data plane's share of the core's numbers."""

    target: str
    connected: bool = False
    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    steps: int = 0
    computed_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class CoreSnapshot:
    """The core's numbers; sent with every step and whenever it falls idle. The totals are sums
    over its data planes (the counters also over ``earlier``, the cores this one replaced)."""

    stats: dict[str, int]  # replica.STAT_NAMES, summed over data planes and earlier cores
    num_added: int = 0  # AddRequests so far
    unrouted: int = 0  # requests waiting for a data plane to take them
    added_by_frontend: tuple[int, ...] = ()  # num_added, by frontend index
    waiting_by_frontend: tuple[int, ...] = ()  # waiting, by frontend index
    earlier: DataPlaneSnapshot = field(default_factory=lambda: DataPlaneSnapshot("earlier cores"))
    dataplane_step: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))  # data-plane seconds per step
    dataplanes: list[DataPlaneSnapshot] = field(default_factory=list)

    def _total(self, name: str, earlier: bool = False) -> int:
        return sum(getattr(part, name) for part in ([self.earlier] if earlier else []) + self.dataplanes)

    @property
    def waiting(self) -> int:
        return self.unrouted + self._total("waiting")

    @property
    def running(self) -> int:
        return self._total("running")

    @property
    def free_kv_blocks(self) -> int:
        return self._total("free_kv_blocks")

    @property
    def num_kv_blocks(self) -> int:
        return self._total("num_kv_blocks")

    @property
    def num_preemptions(self) -> int:
        return self._total("num_preemptions", earlier=True)

    @property
    def prefix_cache_queries(self) -> int:
        return self._total("prefix_cache_queries", earlier=True)

    @property
    def prefix_cache_hits(self) -> int:
        return self._total("prefix_cache_hits", earlier=True)


# ---- frontend -> engine core ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Configure:
    """Frontend 0's first message to a new core (so no secret shows on a command line)."""

    config: ControlPlaneConfig
    counters: CoreSnapshot | None  # the last snapshot of the core this one replaces, whose counters it carries on


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A new request; or one a previous core had started (its tokens so far), to recompute."""

    seq_id: int
    request_id: str
    prompt: list[int]
    params: RequestParams
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Abort:
    """The frontend ended this sequence (cancelled, stop string, failed): free its blocks now."""

    seq_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Frontend 0 stops the core."""


CoreMessage = Configure | AddRequest | Abort | Shutdown


# ---- engine core -> frontends -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connected:
    """A data plane connected (or one was lost while others remain): the limits every connected one meets."""

    describe: dp.DescribeResponse
    snapshot: CoreSnapshot


@dataclass(frozen=True, slots=True)
class Lost:
    """No data plane is connected: NOT_SERVING until one is."""


@dataclass(frozen=True, slots=True)
class Stalled:
    """Every connected data plane has not answered for stall_timeout (True), or one answers again."""

    stalled: bool


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """A step's sampled tokens (those of the receiving frontend's sequences), with the core's numbers."""

    outputs: list[TokenOutput]
    snapshot: CoreSnapshot

    def __reduce__(self):
        # The hot path: pickled as plain tuples, several times cheaper than NamedTuples one by one.
        return _step_outputs, (list(map(tuple, self.outputs)), self.snapshot)


def _step_outputs(rows: list[tuple], snapshot: CoreSnapshot) -> StepOutputs:
    return StepOutputs(list(map(_token_output, rows)), snapshot)


@dataclass(frozen=True, slots=True)
class StepFailed:
    """The data plane could not run a step: the requests in it fail."""

    seq_ids: list[int]
    error: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Sequences the core ended because no connected data plane can ever hold them: (seq_id, why)."""

    reasons: list[tuple[int, str]]


@dataclass(frozen=True, slots=True)
class Rejected:
    """A request the core cannot run: a value the plan's fields cannot carry, or what constrains its
    tokens failed it (Engine.rejected)."""

    seq_id: int
    why: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The core's numbers, when there are no tokens to send with them."""

    snapshot: CoreSnapshot


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The core is alive (sent every HEARTBEAT_INTERVAL, busy or idle)."""


FrontendMessage = Connected | Lost | Stalled | StepOutputs | StepFailed | Refused | Rejected | Snapshot | Heartbeat


# ---- primary frontend <-> secondary frontends -------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartFrontend:
    """The primary's first message to a secondary: serve as frontend index with config."""

    config: ControlPlaneConfig
    security: object  # main.Security
    index: int


@dataclass(frozen=True, slots=True)
class NewCore:
    """Sent with one file descriptor: the secondary's end of its channel to a new engine core."""


@dataclass(frozen=True, slots=True)
class StopFrontend:
    """Stop accepting requests and give the streams in flight grace seconds."""

    grace: float


@dataclass(frozen=True, slots=True)
class FrontendMetrics:
    """A secondary's request metrics (every HEARTBEAT_INTERVAL), for the primary's /metrics."""

    metrics: EngineMetrics
