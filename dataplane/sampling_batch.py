"""Host-side preparation of one step's sampling parameters as device tensors.

Built once per step from each sampled sequence's ``SamplingParams``, its output position
(tokens generated so far) and its token history; the sampler then works on whole-batch
tensors. Features no row uses stay ``None`` so the sampler can skip them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from twinplane.dataplane.plan import SamplingParams


def to_device(values, device: torch.device) -> torch.Tensor:
    """Host values (array, tensor or list) on device, without waiting for the device.

    On CUDA a copy from pageable memory may first wait for all work queued on the stream, so a
    step's launch would wait for the previous step to finish and the GPU would idle while the
    rest of the step is launched. The values go through pinned memory instead (the caching host
    allocator reuses it once the copy is done), and the copy is only queued.
    """
    tensor = torch.as_tensor(values)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingRow:
    """One sampled sequence: its parameters, output position and history (-1 = unknown token)."""

    params: SamplingParams
    output_pos: int
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    allowed: bytes | None = None  # packed bitmask of the tokens it may sample (params.masked), bit t of byte t // 8


@dataclass
class PenaltyTensors:
    repetition: torch.Tensor  # float32 [n, 1]
    presence: torch.Tensor  # float32 [n, 1]
    frequency: torch.Tensor  # float32 [n, 1]
    prompt_counts: torch.Tensor  # float32 [n, vocab]
    output_counts: torch.Tensor  # float32 [n, vocab]


@dataclass
class TokenMasks:
    """Structured output's token masks on the device, packed: the tokens a masked row may sample."""

    packed: torch.Tensor  # uint8 [m, ceil(vocab / 8)]: bit t % 8 of byte t // 8 allows token t
    index: torch.Tensor  # int32 [n]: the mask each row samples within; -1 for rows without one

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """bool [n, vocab]: the tokens each row may sample (all of them for a row without a mask)."""
        bits = torch.arange(8, dtype=torch.uint8, device=self.packed.device)
        unpacked = ((self.packed.unsqueeze(-1) >> bits) & 1).view(len(self.packed), -1)[:, :vocab_size].bool()
        return unpacked[self.index.clamp(min=0).long()] | (self.index < 0).unsqueeze(1)


@dataclass
class SamplingBatch:
    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor  # bool [n]
    temperature: torch.Tensor  # float32 [n, 1]; 1.0 on greedy rows
    top_k: torch.Tensor | None  # int64 [n, 1]; vocab = off
    top_p: torch.Tensor | None  # float32 [n, 1]
    min_p: torch.Tensor | None  # float32 [n, 1]
    penalties: PenaltyTensors | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to mask to -inf (min_tokens)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) of logit_bias
    masks: TokenMasks | None  # structured output's token masks
    seeded: list[tuple[int, int, int]]  # (row, seed, output position)
    num_logprobs: list[int]  # per row; -1 = none
    # seeded rows the Triton sampler takes (temperature and token masks only): it draws them in any batch,
    # so that a seed's token does not depend on the rows beside it
    seeded_kernel_rows: list[int] = field(default_factory=list)

    @property
    def kernel_samples(self) -> bool:
        """Whether the Triton sampler (``kernels/sampling.py``) takes it: rows use temperature and token masks,
        no penalties, min_tokens masking, logit bias, min_p, top_k or top_p."""
        return (self.penalties is None and self.banned is None and self.bias is None and self.min_p is None
                and self.top_k is None and self.top_p is None)

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs, default=-1)

    @classmethod
    def from_plain_values(cls, values: np.ndarray, vocab_size: int, device: torch.device) -> SamplingBatch:
        """Rows that only use temperature, top_p, top_k and min_p: values float32 [n, 4] in that order.

        One host-to-device copy; no Python loop over rows.
        """
        columns, flags = plain_columns(values, vocab_size)
        return cls.from_plain_columns(values, to_device(columns, device), to_device(flags, device), vocab_size)

    @classmethod
    def from_plain_columns(cls, values: np.ndarray, columns: torch.Tensor, flags: torch.Tensor,
                           vocab_size: int) -> SamplingBatch:
        """The same from ``plain_columns(values)`` already on the device (views, no device work)."""
        n = len(values)
        top_p, top_k, min_p = _filters_on(values, vocab_size)
        on_device = columns.view(torch.float32).view(4, n)
        return cls(
            num_rows=n,
            all_greedy=bool((values[:, 0] == 0.0).all()),
            greedy=flags.view(torch.uint8)[:n].view(torch.bool),
            temperature=on_device[0].unsqueeze(1),
            top_k=on_device[2].long().unsqueeze(1) if top_k else None,
            top_p=on_device[1].unsqueeze(1) if top_p else None,
            min_p=on_device[3].unsqueeze(1) if min_p else None,
            penalties=None,
            banned=None,
            bias=None,
            masks=None,
            seeded=[],
            num_logprobs=[-1] * n,
        )


def _filters_on(values: np.ndarray, vocab_size: int) -> tuple[bool, bool, bool]:
    """Whether any row of plain sampling values [n, 4] (temperature, top_p, top_k, min_p) filters by top-p,
    by top-k and by min-p."""
    _, top_p, top_k, min_p = values.T
    return bool((top_p < 1.0).any()), bool(((top_k > 0) & (top_k < vocab_size)).any()), bool((min_p > 0.0).any())


def temperature_only(values: np.ndarray, vocab_size: int) -> bool:
    """Whether plain sampling values [n, 4] use temperature alone (what ``SamplingBatch.kernel_samples``
    says of the batch built from them)."""
    return not any(_filters_on(values, vocab_size))


def plain_columns(values: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """What the device needs of plain sampling values [n, 4] (temperature, top_p, top_k, min_p), as two
    int32 arrays to copy with a step's other inputs: the four columns one after another (float32 bits;
    greedy rows' temperature 1, top_k off as vocab_size), and each row's greedy flag as one byte."""
    n = len(values)
    columns = np.array(values.T, dtype=np.float32)  # a copy, column after column
    greedy = columns[0] == 0.0
    columns[0, greedy] = 1.0
    top_k = columns[2]
    columns[2] = np.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    flags = np.zeros(-(-n // 4) * 4, dtype=np.uint8)
    flags[:n] = greedy
    return columns.view(np.int32).ravel(), flags.view(np.int32)


def _column(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype).unsqueeze(1), device)


def _token_counts(histories: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [n, vocab]: occurrences of each token per row; ids outside [0, vocab) are ignored."""
    width = max((len(h) for h in histories), default=0)
    padded = np.full((len(histories), max(width, 1)), vocab_size, dtype=np.int64)
    for row, history in enumerate(histories):
        padded[row, : len(history)] = history
    padded[(padded < 0) | (padded > vocab_size)] = vocab_size
    ids = to_device(padded, device)
    counts = torch.zeros(len(histories), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> PenaltyTensors | None:
    if not any(r.params.has_penalties for r in rows):
        return None
    with_history = [r if r.params.has_penalties else None for r in rows]
    empty = np.empty(0, dtype=np.int64)
    return PenaltyTensors(
        repetition=_column([r.params.repetition_penalty for r in rows], torch.float32, device),
        presence=_column([r.params.presence_penalty for r in rows], torch.float32, device),
        frequency=_column([r.params.frequency_penalty for r in rows], torch.float32, device),
        prompt_counts=_token_counts([r.prompt_ids if r else empty for r in with_history], vocab_size, device),
        output_counts=_token_counts([r.output_ids if r else empty for r in with_history], vocab_size, device),
    )


def _banned(rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    pairs = [(i, t) for i, r in enumerate(rows) if r.output_pos < r.params.min_tokens
             for t in r.params.stop_token_ids]
    if not pairs:
        return None
    row_ids, token_ids = zip(*pairs)
    return (to_device(torch.tensor(row_ids, dtype=torch.int64), device),
            to_device(torch.tensor(token_ids, dtype=torch.int64), device))


def _bias(rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(i, t, v) for i, r in enumerate(rows) for t, v in r.params.logit_bias]
    if not entries:
        return None
    row_ids, token_ids, values = zip(*entries)
    return (to_device(torch.tensor(row_ids, dtype=torch.int64), device),
            to_device(torch.tensor(token_ids, dtype=torch.int64), device),
            to_device(torch.tensor(values, dtype=torch.float32), device))


def token_masks(masks: list[bytes | None], device: torch.device) -> TokenMasks | None:
    """Each row's token mask or None, packed on the device (a mask object several rows share is copied once),
    and which mask each row takes."""
    if all(m is None for m in masks):
        return None
    places: dict[int, int] = {}  # id of a mask object -> its row among the packed masks
    index = [-1 if m is None else places.setdefault(id(m), len(places)) for m in masks]
    unique = {id(m): m for m in masks if m is not None}.values()  # in the order of places
    packed = np.frombuffer(bytearray(b"".join(unique)), dtype=np.uint8).reshape(len(places), -1)
    return TokenMasks(to_device(packed, device), to_device(np.array(index, dtype=np.int32), device))


def warm_up_rows(vocab_size: int) -> list[SamplingRow]:
    """Two rows that between them use every sampling feature (ids < 8): a warm-up batch."""
    everything = SamplingParams(temperature=0.8, top_p=0.9, top_k=4, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=0.5, seed=7, num_logprobs=5, min_tokens=4,
                                stop_token_ids=(0,), logit_bias=((1, 2.0),), masked=True)
    history = np.array([1, 2, 3], dtype=np.int32), np.array([4, -1], dtype=np.int32)
    greedy = SamplingParams(temperature=0.0, num_logprobs=0)
    allowed = bytes([0b11111110]) + bytes(-(-vocab_size // 8) - 1)  # ids 1-7
    return [SamplingRow(everything, 2, *history, allowed), SamplingRow(greedy, 2, *history)]


def build_sampling_batch(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> SamplingBatch:
    """Tensors for ``rows``, in row order."""
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    return SamplingBatch(
        num_rows=len(rows),
        all_greedy=all(greedy),
        greedy=to_device(torch.tensor(greedy, dtype=torch.bool), device),
        temperature=_column([1.0 if p.greedy else p.temperature for p in params], torch.float32, device),
        top_k=_column(top_k, torch.int64, device) if any(k < vocab_size for k in top_k) else None,
        top_p=_column([p.top_p for p in params], torch.float32, device) if any(p.top_p < 1.0 for p in params) else None,
        min_p=_column([p.min_p for p in params], torch.float32, device) if any(p.min_p > 0.0 for p in params) else None,
        penalties=_penalties(rows, vocab_size, device),
        banned=_banned(rows, device),
        bias=_bias(rows, device),
        masks=token_masks([r.allowed for r in rows], device),
        seeded=[(i, r.params.seed, r.output_pos) for i, r in enumerate(rows)
                if r.params.seed is not None and not r.params.greedy],
        num_logprobs=[p.num_logprobs for p in params],
        seeded_kernel_rows=[i for i, r in enumerate(rows) if r.params.seed is not None and not r.params.greedy
                            and _kernel_takes(r, vocab_size)],
    )


def _kernel_takes(row: SamplingRow, vocab_size: int) -> bool:
    """Whether the Triton sampler takes the row (``SamplingBatch.kernel_samples`` of a batch of it alone)."""
    p = row.params
    return (not p.has_penalties and not p.logit_bias and p.top_p >= 1.0 and p.min_p == 0.0
            and not 0 < p.top_k < vocab_size and not (row.output_pos < p.min_tokens and p.stop_token_ids))
