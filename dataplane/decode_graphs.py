"""Decode steps as CUDA graphs that sample too: the forward pass, the logits, the temperature
sampler (``kernels/sampling.py``) and the store of the tokens, one graph per (batch size, step).

A plan of K decode steps feeds each step's sampled tokens to the next one on the device. At a
few sequences a step needs about 0.7 ms of GPU time (Qwen3-0.6B on an H200), and queueing it
step by step from the host (the forward graph's replay, the logits GEMM, the sampler's
kernels, the token store) cost nearly as much: the GPU waited on the host. Here step k of a
plan at padded batch size b is one graph, whose tokens step k + 1 reads. A plan copies its
inputs into the graphs' buffers in one call and replays K graphs.

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
store nothing and attend to nothing, and the tokens they sample are never read back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twinplane.dataplane.attention_backends.base import AttentionMetadata
from twinplane.dataplane.cuda_graphs import bucket
from twinplane.dataplane.input_batch import StepInputs
from twinplane.dataplane.models.decoder import DecoderForCausalLM

MAX_BATCH = 8  # plans of several steps are for a few sequences; larger ones take the loop
# Steps held: the control plane's default plan length (--decode-steps). A plan may ask for up to
# MAX_DECODE_STEPS (64); one graph per (batch size, step) for all of those would be 256 captures
# at every start-up, so longer plans take the loop.
MAX_STEPS = 8


class SampledDecodeGraphs:
    """Step k of a plan of decode steps at padded batch b: forward, logits, sampling, token store.
    Steps 0 .. num_steps - 1 at batch sizes up to MAX_BATCH, step 0 at the larger ones."""

    def __init__(self, model: DecoderForCausalLM, draw_key: torch.Tensor, batch_sizes: list[int], max_model_len: int,
                 block_size: int, pool=None, num_steps: int = MAX_STEPS) -> None:
        """draw_key: the sampler's (``Sampler.draw_key``); each replay reads and advances it."""
        self.model, self.num_steps, self.max_model_len, self.pool = model, num_steps, max_model_len, pool
        self.draw_key, device = draw_key, draw_key.device
        self.batch_sizes = batch_sizes
        width, k = self.batch_sizes[-1], num_steps
        i32 = dict(dtype=torch.int32, device=device)
        self.first_ids = torch.zeros(width, **i32)  # step 0's inputs; step k > 0 reads tokens[k - 1]
        self.positions = torch.zeros(k, width, **i32)
        self.slots = torch.full((k, width), -1, **i32)
        self.context_lens = torch.zeros(k, width, **i32)
        self.block_tables = torch.zeros(width, -(-max_model_len // block_size), **i32)
        self.cu_seqlens_q = torch.arange(width + 1, **i32)
        self.rows = torch.arange(width, **i32)
        self.order = torch.arange(width, **i32)
        self.temperature = torch.ones(width, dtype=torch.float32, device=device)
        self.greedy = torch.ones(width, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(k, width, **i32)
        self.replays: dict[tuple[int, int], Callable[[], None]] = {}

    def fits(self, inputs: StepInputs) -> bool:
        """Whether this plan can replay the graphs: sampling with temperature only, and either a plan
        of several decode steps of few enough sequences and steps (InputBatch admits those only of
        sequences without seeds, log-probabilities or penalties), or one decode step in which every
        sequence samples, without seeds or log-probabilities."""
        sampling, n, steps = inputs.sampling, inputs.input_ids.shape[0], inputs.decode_steps
        if sampling is None or not sampling.temperature_only:
            return False
        if steps is not None:
            return n <= MAX_BATCH and steps.num_steps <= self.num_steps
        return (inputs.metadata.max_seqlen_q == 1 and inputs.sample_indices.shape[0] == n <= self.batch_sizes[-1]
                and not sampling.seeded and sampling.max_num_logprobs < 0)

    def _metadata(self, k: int, bs: int) -> AttentionMetadata:
        cu = self.cu_seqlens_q[:bs + 1]
        return AttentionMetadata(
            cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=self.context_lens[k, :bs], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, slot_mapping=self.slots[k, :bs], block_tables=self.block_tables[:bs],
            query_lens_host=[1] * bs, context_lens_host=[1] * bs, decode_order=self.order[:bs])

    def _step(self, k: int, bs: int) -> None:
        """Step k at batch bs, on the buffers (what each graph holds)."""
        from twinplane.kernels.sampling import sample_temperature

        ids = self.first_ids[:bs] if k == 0 else self.tokens[k - 1, :bs]
        hidden = self.model(ids, self.positions[k, :bs], self._metadata(k, bs))
        logits = self.model.compute_logits(hidden)
        sample_temperature(logits, self.temperature[:bs], self.greedy[:bs], out=self.tokens[k, :bs],
                           draw_key=self.draw_key)

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
        key = self.draw_key.clone()
        self.context_lens.fill_(1)
        for bs in reversed(self.batch_sizes):
            for k in range(self.num_steps if bs <= MAX_BATCH else 1):
                self.replays[(bs, k)] = self._record(lambda k=k, bs=bs: self._step(k, bs))
        self.draw_key.copy_(key)
        if key.is_cuda:
            torch.cuda.synchronize(key.device)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replays the plan's steps (``fits`` holds). Returns the sampled
        tokens, int32 [K, n] (a view of the graphs' buffer)."""
        steps, metadata, sampling = inputs.decode_steps, inputs.metadata, inputs.sampling
        n = inputs.input_ids.shape[0]
        if steps is None:  # one step
            k, per_step = 1, [t.view(1, n) for t in (inputs.positions, metadata.slot_mapping, metadata.context_lens)]
        else:
            k, per_step = steps.num_steps, [steps.positions, steps.slot_mapping, steps.context_lens]
        bs, width = bucket(self.batch_sizes, n), metadata.block_tables.shape[1]
        targets = [self.first_ids[:n], self.positions[:k, :n], self.slots[:k, :n], self.context_lens[:k, :n],
                   self.block_tables[:n, :width], self.order[:n], self.temperature[:n], self.greedy[:n]]
        sources = [inputs.input_ids, *per_step, metadata.block_tables, metadata.decode_order,
                   sampling.temperature.view(-1), sampling.greedy]
        if n < bs:  # padding sequences start last
            targets.append(self.order[n:bs])
            sources.append(self.rows[n:bs])
        torch._foreach_copy_(targets, sources)
        if n < bs:
            self.slots[:k, n:bs] = -1
            self.context_lens[:k, n:bs] = 0
        for step in range(k):
            self.replays[(bs, step)]()
        return self.tokens[:k, :n]
