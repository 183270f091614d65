"""Batched next-token sampling from float32 logits [n, vocab].

Order of operations per row (as vLLM): logit bias, penalties (repetition over prompt + output,
frequency and presence over output), min_tokens masking of stop ids and token masks (structured
output: tokens outside a row's mask are -inf); greedy rows take
the argmax here. Other rows: temperature, min_p, top_k, top_p, then an exponential race
(argmax of probs / Exp(1) noise), which draws exactly from the filtered distribution. A
seeded row's noise comes from a generator seeded by (seed, output position) alone, so its
draws do not depend on batching or recomputation; other rows share one generator.
Log-probabilities are the log_softmax of the raw model logits.

Batches whose rows use only temperature (the common case), and token masks, take two Triton kernels on
CUDA (``kernels/sampling.py``: an inverse-CDF draw, the same distribution) instead of about ten
passes over a float32 copy of the logits. There a row's uniform number is Philox keyed by
seed_for_position(seed, output position) for seeded rows, and for the others by the draw's key plus the
row's index: the sampler's ``draw_key``, kept on the device, which each draw advances there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from twinplane.dataplane.plan import SamplingParams
from twinplane.dataplane.sampling_batch import (PenaltyTensors, SamplingBatch, build_sampling_batch, to_device,
                                                warm_up_rows)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [n]
    logprobs: torch.Tensor | None = None  # float32 [n]: the sampled tokens' logprobs
    top_ids: torch.Tensor | None = None  # int64 [n, max_num_logprobs], most likely first
    top_logprobs: torch.Tensor | None = None  # float32 [n, max_num_logprobs]


def seed_for_position(seed: int, output_pos: int) -> int:
    """A 63-bit generator seed that depends only on (seed, output position)."""
    digest = hashlib.blake2b(f"{seed}:{output_pos}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition divides positive / multiplies negative logits of seen tokens; then
    logits -= frequency * output_count + presence * (output_count > 0)."""
    seen = (penalties.prompt_counts + penalties.output_counts) > 0
    repeated = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
    logits = torch.where(seen, repeated, logits)
    output_counts = penalties.output_counts
    return logits - penalties.frequency * output_counts - penalties.presence * (output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens (and any tied with the k-th), then the fewest most likely of those
    whose probability reaches top_p, as transformers' and vLLM's filters do."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the most likely last
    if top_k is not None:  # off: top_k = vocab, so the k-th is the smallest
        kth = sorted_logits.gather(-1, logits.shape[-1] - top_k)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # of this token and every less likely one
        drop = mass_up_to <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, penalties, min_tokens masking and token masks: what greedy rows take the argmax of. Never in place
    (logits may be the model's own, which log-probabilities read)."""
    if batch.bias is not None:
        rows, token_ids, values = batch.bias
        logits = logits.index_put((rows, token_ids), values, accumulate=True)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.banned is not None or batch.masks is not None:
        minus_inf = torch.full((), float("-inf"), device=logits.device)  # made there: no copy from the host
    if batch.banned is not None:
        logits = logits.index_put((batch.banned[0], batch.banned[1]), minus_inf)
    if batch.masks is not None:
        logits = logits.where(batch.masks.allowed(logits.shape[-1]), minus_inf)
    return logits


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p: what a drawing row samples from (removed tokens -inf)."""
    logits = logits / batch.temperature
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


class Sampler:
    """Samples one token per row; owns the generator shared by unseeded rows.

    ``fused``: use the Triton kernel for temperature-only batches (default: on CUDA).
    """

    def __init__(self, seed: int, device: torch.device, fused: bool | None = None) -> None:
        self.device = device
        self.fused = device.type == "cuda" if fused is None else fused
        self.generator = torch.Generator(device=device)
        # the key of row 0 of the next kernel draw of unseeded rows (row i: key + i), on the device
        self.draw_key = torch.zeros(1, dtype=torch.int64, device=device)
        self.reseed(seed)

    @torch.inference_mode()
    def reseed(self, seed: int) -> None:
        """Starts the draws of unseeded rows over, as a new sampler with this seed would make them."""
        self.seed = seed
        self.generator.manual_seed(seed)
        self.draw_key.fill_(seed_for_position(seed, 0) >> 3)  # leaves room for 2**40 draws below 2**63

    def warm_up(self, logits: torch.Tensor) -> None:
        """Samples from ``logits`` [n >= 2, vocab] once per path: the fused kernel of temperature-only
        batches, without and with token masks and seeds (it compiles now, not in the first request's time),
        then every feature of the torch path. CUDA loads a kernel's module on its first launch, for ~1-20 ms
        of host time (measured on an H200); left to the first request with top-p or penalties, that stalls
        every stream."""
        plain = np.zeros((logits.shape[0], 4), dtype=np.float32)
        plain[:, 1], plain[::2, 0] = 1.0, 0.7  # top_p off; temperature 0.7 or greedy
        vocab = logits.shape[1]
        if self.fused:
            self(logits, SamplingBatch.from_plain_values(plain, vocab, self.device))
            everything, greedy = warm_up_rows(vocab)
            for seed in (None, 7):
                masked = replace(everything, params=SamplingParams(temperature=0.7, seed=seed, masked=True))
                self(logits[:2], build_sampling_batch([masked, greedy], vocab, self.device))
        plain[:, 1:] = 0.9, 50, 0.05  # top_p, top_k, min_p
        self(logits, SamplingBatch.from_plain_values(plain, vocab, self.device))
        self(logits[:2], build_sampling_batch(warm_up_rows(vocab), vocab, self.device))

    def _fused_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        from twinplane.kernels.sampling import KEY_STRIDE, sample_temperature

        temperature = batch.temperature.view(-1)
        masks = {} if batch.masks is None else {"masks": batch.masks.packed, "mask_index": batch.masks.index}
        if not batch.seeded:
            return sample_temperature(logits, temperature, batch.greedy, draw_key=self.draw_key, **masks)
        seeds = torch.arange(batch.num_rows, dtype=torch.int64, device=logits.device) + self.draw_key
        rows, keys = zip(*((row, seed_for_position(seed, pos)) for row, seed, pos in batch.seeded))
        seeds[to_device(torch.tensor(rows), logits.device)] = to_device(torch.tensor(keys, dtype=torch.int64),
                                                                        logits.device)
        self.draw_key += KEY_STRIDE
        return sample_temperature(logits, temperature, batch.greedy, seeds, **masks)

    def _race_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed, output_pos in batch.seeded:
            row_generator = torch.Generator(device=self.device).manual_seed(seed_for_position(seed, output_pos))
            noise[row].exponential_(generator=row_generator)
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _random_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = filter_logits(logits, batch).softmax(dim=-1)
        return (probs / self._race_noise(probs, batch)).argmax(dim=-1)

    def _logprobs(self, raw_logits: torch.Tensor, token_ids: torch.Tensor, out: SamplerOutput,
                  max_num_logprobs: int) -> None:
        logprobs = raw_logits.float().log_softmax(dim=-1)
        out.logprobs = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        if max_num_logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(max_num_logprobs, dim=-1)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (
            f"logits {tuple(logits.shape)} do not match {batch.num_rows} sampling rows")
        raw_logits = logits
        if self.fused and batch.kernel_samples:
            token_ids = self._fused_sample(logits, batch)
        else:
            token_ids = self._sample(logits.float(), batch)
            if self.fused and batch.seeded_kernel_rows:  # drawn as they would be alone (SamplingBatch)
                rows = to_device(torch.tensor(batch.seeded_kernel_rows), logits.device)
                token_ids[rows] = self._fused_sample(logits, batch)[rows]
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_num_logprobs >= 0:
            self._logprobs(raw_logits, token_ids, out, batch.max_num_logprobs)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = adjust_logits(logits, batch)
        token_ids = logits.argmax(dim=-1)
        if not batch.all_greedy:
            token_ids = torch.where(batch.greedy, token_ids, self._random_sample(logits, batch))
        return token_ids
