"""Decode steps as CUDA graphs that sample too: the forward pass, the logits, the temperature
sampler (``kernels/sampling.py``) and the store of the tokens, one graph per (batch size, step).

A plan of K decode steps feeds each step's sampled tokens to the next one on the device. At a
few sequences a step needs about 0.7 ms of GPU time (Qwen3-0.6B on an H200), and queueing it
step by step from the host (the forward graph's replay, the logits GEMM, the sampler's
kernels, the token store) cost nearly as much: the GPU waited on the host. Here step k of a
plan at padded batch size b is one graph, whose tokens step k + 1 reads. ``InputBatch`` stages
such a plan straight into the graphs' input buffer (``GraphInputs``): one host-to-device copy,
no copies between device buffers; the plan then replays K graphs.

A plan of one decode step at any batch size replays step 0's graph the same way. Queued
op by op, its logits and sampling cost the host ~0.6 ms (an H200's host, ~30-45 sequences)
on top of the inputs and the forward graph's replay, and at tens of streams that launch, not
the GPU, set the pace of the steps (BENCHMARKS.md).

The graphs draw what the step-by-step path of ``ModelRunner`` draws: the same forward shape
and logits rows, and the Philox keys of the sampler's ``draw_key``, which each step's sampling
reads and advances on the device as the loop's does.
They serve tensor-parallel size 1 (the loop broadcasts each step's tokens from rank 0) and
batches that sample with temperature only, with no seeded rows and no log-probabilities;
other plans take the loop.

Padding sequences (a batch below its bucket) have context 0 and slot -1 in every step: they
store nothing and attend to nothing, and the tokens they sample are never read back. The
plan's staging writes those too, on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.cuda_graphs import bucket
from twinplane.dataplane.models.decoder import DecoderForCausalLM

MAX_BATCH = 8  # plans of several steps are for a few sequences; larger ones take the loop
# Steps held: the control plane's default plan length (--decode-steps). A plan may ask for up to
# MAX_DECODE_STEPS (64); one graph per (batch size, step) for all of those would be 256 captures
# at every start-up, so longer plans take the loop.
MAX_STEPS = 8


@dataclass
class InputViews:
    """The parts of a GraphInputs buffer (device) or of its mirror on the host (numpy)."""

    first_ids: Any  # [width]: step 0's tokens
    rows: Any  # [width]: each sequence's batch row (where its last token is kept)
    order: Any  # [width]: decode order, longest context first
    last: Any  # [MAX_BATCH]: where each sequence's last token lands in the [K, n] tokens, flattened
    temperature: Any  # float32 [width]
    greedy: Any  # bool [width]
    positions: list  # a [rows] view a step
    slots: list
    context_lens: list
    block_tables: Any  # [width, max_blocks]


class GraphInputs:
    """What the graphs read, in one int32 buffer: per row (``width`` rows, the largest batch size)
    the first step's token, the sequence's batch row, the decode order, the temperature (float32
    bits) and the greedy flag (a byte); step 0's positions, slots and context lengths; those of
    steps 1 .. K-1 (plans of several steps: MAX_BATCH rows); where each sequence's last token
    lands in the [K, n] tokens; and the block tables (width x max_blocks) last, so that a plan of
    n sequences copies only the first ``end(n)`` entries. The host stages a plan in a mirror of
    this layout (``views`` of its pinned staging buffer) and copies it over in one call."""

    def __init__(self, batch_sizes: list[int], num_steps: int, max_blocks: int, device: torch.device) -> None:
        self.batch_sizes, self.num_steps, self.max_blocks = batch_sizes, num_steps, max_blocks
        self.width = w = batch_sizes[-1]
        sizes = {"first_ids": w, "rows": w, "order": w, "temperature": w, "greedy": -(-w // 4), "step0": 3 * w,
                 "later": 3 * (num_steps - 1) * MAX_BATCH, "last": MAX_BATCH, "block_tables": w * max_blocks}
        self._spans, end = {}, 0
        for name, size in sizes.items():  # each part 16-byte aligned
            self._spans[name], end = (end, size), end + -(-size // 4) * 4
        self.size = end
        self.buffer = torch.zeros(self.size, dtype=torch.int32, device=device)
        self.parts = self.views(self.buffer)

    def takes(self, num_seqs: int, num_steps: int) -> bool:
        """Whether graphs are held for a plan of this many sequences and decode steps."""
        return num_seqs <= self.width and (num_steps == 1 or (num_seqs <= MAX_BATCH and num_steps <= self.num_steps))

    def end(self, num_seqs: int) -> int:
        """How much of the buffer a plan of num_seqs sequences fills (the rest is padding or unread)."""
        return self._spans["block_tables"][0] + num_seqs * self.max_blocks

    def views(self, buffer) -> InputViews:
        """The parts of ``buffer``, a torch tensor or a numpy array of this layout."""
        numpy = isinstance(buffer, np.ndarray)
        part = {name: buffer[start:start + size] for name, (start, size) in self._spans.items()}
        as_bytes = part["greedy"].view(np.uint8 if numpy else torch.uint8)[:self.width]
        step0 = part["step0"].reshape(3, self.width)
        later = part["later"].reshape(self.num_steps - 1, 3, MAX_BATCH)
        steps = [step0] + [later[k] for k in range(self.num_steps - 1)]
        return InputViews(part["first_ids"], part["rows"], part["order"], part["last"],
                          part["temperature"].view(np.float32 if numpy else torch.float32),
                          as_bytes.view(bool if numpy else torch.bool), [s[0] for s in steps], [s[1] for s in steps],
                          [s[2] for s in steps], part["block_tables"].reshape(self.width, self.max_blocks))


class SampledDecodeGraphs:
    """Step k of a plan of decode steps at padded batch b: forward, logits, sampling, token store.
    Steps 0 .. num_steps - 1 at batch sizes up to MAX_BATCH, step 0 at the larger ones."""

    def __init__(self, model: DecoderForCausalLM, draw_key: torch.Tensor, batch_sizes: list[int], max_model_len: int,
                 block_size: int, pool=None, num_steps: int = MAX_STEPS) -> None:
        """draw_key: the sampler's (``Sampler.draw_key``); each replay reads and advances it."""
        self.model, self.num_steps, self.max_model_len, self.pool = model, num_steps, max_model_len, pool
        self.draw_key, device = draw_key, draw_key.device
        self.batch_sizes = batch_sizes
        self.inputs = GraphInputs(batch_sizes, num_steps, -(-max_model_len // block_size), device)
        width = self.inputs.width
        self.cu_seqlens_q = torch.arange(width + 1, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(num_steps, width, dtype=torch.int32, device=device)
        self.replays: dict[tuple[int, int], Callable[[], None]] = {}

    def _metadata(self, k: int, bs: int) -> AttentionMetadata:
        cu, i = self.cu_seqlens_q[:bs + 1], self.inputs.parts
        return AttentionMetadata(
            cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=i.context_lens[k][:bs], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, slot_mapping=i.slots[k][:bs], block_tables=i.block_tables[:bs],
            query_lens_host=[1] * bs, context_lens_host=[1] * bs, decode_order=i.order[:bs])

    def _step(self, k: int, bs: int) -> None:
        """Step k at batch bs, on the buffers (what each graph holds)."""
        from twinplane.kernels.sampling import sample_temperature

        i = self.inputs.parts
        ids = i.first_ids[:bs] if k == 0 else self.tokens[k - 1, :bs]
        hidden = self.model(ids, i.positions[k][:bs], self._metadata(k, bs))
        logits = self.model.compute_logits(hidden)
        sample_temperature(logits, i.temperature[:bs], i.greedy[:bs], out=self.tokens[k, :bs], draw_key=self.draw_key)

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Runs ``step`` once (kernels compile, allocations settle), captures it; returns its replay."""
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay

    @torch.inference_mode()
    def capture(self) -> None:
        """Records every (batch size, step); the warm-up lengths are 1 and slots -1 (nothing stored).
        The draw key is put back as it was: recording draws."""
        key, i = self.draw_key.clone(), self.inputs.parts
        for k in range(self.num_steps):
            i.context_lens[k].fill_(1)
            i.slots[k].fill_(-1)
        i.order.copy_(torch.arange(len(i.order), device=i.order.device))
        for bs in reversed(self.batch_sizes):
            for k in range(self.num_steps if bs <= MAX_BATCH else 1):
                self.replays[(bs, k)] = self._record(lambda k=k, bs=bs: self._step(k, bs))
        self.draw_key.copy_(key)
        if key.is_cuda:
            torch.cuda.synchronize(key.device)

    def replay(self, num_seqs: int, num_steps: int) -> torch.Tensor:
        """Replays the steps of a plan staged in ``inputs`` (``GraphInputs.takes`` holds). Returns the
        sampled tokens, int32 [num_steps, num_seqs] (a view of the graphs' buffer)."""
        bs = bucket(self.batch_sizes, num_seqs)
        for step in range(num_steps):
            self.replays[(bs, step)]()
        return self.tokens[:num_steps, :num_seqs]
