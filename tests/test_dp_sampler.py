"""Sampler: greedy, filters, seeded reproducibility, penalties, min_tokens and logprobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from twinplane.dataplane.plan import SamplingParams
from twinplane.dataplane.sampler import Sampler, apply_min_p, apply_penalties
from twinplane.dataplane.sampling_batch import SamplingBatch, SamplingRow, build_sampling_batch, warm_up_rows

CPU = torch.device("cpu")
EMPTY = np.empty(0, dtype=np.int32)


def _rows(params: list[SamplingParams], output_pos: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, output_pos, EMPTY, EMPTY) for p in params]


def _sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0):
    batch = build_sampling_batch(rows, logits.shape[-1], CPU)
    return Sampler(seed, CPU)(logits, batch), batch


def _random_logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_on_the_fast_path() -> None:
    logits = _random_logits(5, 100)
    out, batch = _sample(logits, _rows([SamplingParams(temperature=0.0)] * 5))
    assert batch.all_greedy and batch.penalties is None and out.logprobs is None
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(temperature=1e-4), SamplingParams(min_p=0.999)])
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _random_logits(8, 300, seed=1)
    out, _ = _sample(logits, _rows([params] * 8))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_min_p_keeps_only_likely_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    filtered = apply_min_p(probs.log().unsqueeze(0), torch.tensor([[0.5]]))
    assert torch.isfinite(filtered[0]).tolist() == [True, True, False, False]
    out, _ = _sample(probs.log().repeat(400, 1), _rows([SamplingParams(min_p=0.5)] * 400))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_top_k_top_p_restrict_support() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    out, _ = _sample(probs.log().repeat(400, 1), _rows([SamplingParams(top_k=3, top_p=0.6)] * 400))
    assert set(out.token_ids.tolist()) == {0, 1}  # top_p 0.6 needs tokens 0 and 1


def test_seeded_rows_ignore_batch_composition_and_order() -> None:
    vocab = 1000
    flat = torch.zeros(1, vocab)
    seeded = SamplingParams(seed=7)
    other = SamplingParams(seed=None)
    alone, _ = _sample(flat, _rows([seeded], output_pos=3), seed=0)
    rows = [SamplingRow(other, 0, EMPTY, EMPTY), SamplingRow(SamplingParams(seed=9), 3, EMPTY, EMPTY),
            SamplingRow(seeded, 3, EMPTY, EMPTY)]
    mixed, _ = _sample(flat.repeat(3, 1), rows, seed=123)
    reordered, _ = _sample(flat.repeat(3, 1), rows[::-1], seed=5)
    assert int(alone.token_ids[0]) == int(mixed.token_ids[2]) == int(reordered.token_ids[0])
    assert int(mixed.token_ids[1]) == int(reordered.token_ids[1])
    assert int(mixed.token_ids[1]) != int(mixed.token_ids[2]), "different seeds should differ"
    later, _ = _sample(flat, _rows([seeded], output_pos=4))
    assert int(later.token_ids[0]) != int(alone.token_ids[0]), "next position should draw anew"


def test_unseeded_rows_follow_the_shared_generator() -> None:
    flat = torch.zeros(4, 1000)
    first, _ = _sample(flat, _rows([SamplingParams()] * 4), seed=1)
    again, _ = _sample(flat, _rows([SamplingParams()] * 4), seed=1)
    other, _ = _sample(flat, _rows([SamplingParams()] * 4), seed=2)
    assert torch.equal(first.token_ids, again.token_ids)
    assert not torch.equal(first.token_ids, other.token_ids)


def test_penalties_follow_the_vllm_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [SamplingRow(params, 3, np.array([0], np.int32), np.array([1, 1, 3], np.int32))]
    batch = build_sampling_batch(rows, 4, CPU)
    assert batch.penalties is not None
    # token 0: in prompt, positive -> 2 / 2; token 1: output twice, negative -> -1 * 2 - 0.5 * 2 - 0.25;
    # token 2: unseen; token 3: output once -> 3 / 2 - 0.5 - 0.25
    expected = torch.tensor([[1.0, -3.25, 0.5, 0.75]])
    torch.testing.assert_close(apply_penalties(logits, batch.penalties), expected)
    out = Sampler(0, CPU)(logits, batch)
    assert int(out.token_ids[0]) == 0


def test_unknown_history_tokens_are_ignored() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    rows = [SamplingRow(params, 0, np.array([-1, -1, 2], np.int32), EMPTY)]
    batch = build_sampling_batch(rows, 4, CPU)
    assert batch.penalties is not None
    assert batch.penalties.prompt_counts.tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    early, _ = _sample(logits, _rows([params], output_pos=1))
    done, _ = _sample(logits, _rows([params], output_pos=2))
    assert int(early.token_ids[0]) == 2 and int(done.token_ids[0]) == 1


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = _random_logits(3, 50, seed=4)
    params = [SamplingParams(temperature=0.0, num_logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.7, num_logprobs=0, seed=3),
              SamplingParams(temperature=0.0)]
    rows = [SamplingRow(p, 1, np.array([0, 1, 2], np.int32), np.array([3], np.int32)) for p in params]
    out, batch = _sample(logits, rows)
    reference = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, reference.gather(-1, out.token_ids.unsqueeze(-1)).squeeze(-1))
    assert out.top_ids.shape == (3, 5)
    top_values, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_values)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    assert batch.num_logprobs == [5, 0, -1]
    assert math.isclose(float(out.top_logprobs[0, 0]), float(reference[0].max()), rel_tol=1e-6)


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
     SamplingParams(temperature=1.3, top_p=0.8, min_p=0.1), SamplingParams(temperature=0.5, top_k=1003),
     SamplingParams(temperature=0.0, top_k=3)],
    [SamplingParams(temperature=0.9), SamplingParams(temperature=0.2)],
    [SamplingParams(temperature=0.0)],
], ids=["every-filter", "temperature-only", "greedy"])
def test_plain_values_build_the_batch_the_general_path_builds(params: list[SamplingParams]) -> None:
    """The fast path (the four values of each row as one array, on the device as views of a step's
    copied inputs) must give the sampler exactly what the row-by-row path gives it."""
    vocab = 1000
    values = np.array([[p.temperature, p.top_p, p.top_k, p.min_p] for p in params], dtype=np.float32)
    plain = SamplingBatch.from_plain_values(values, vocab, CPU)
    general = build_sampling_batch(_rows(params), vocab, CPU)
    assert plain.all_greedy == general.all_greedy and plain.num_rows == general.num_rows == len(params)
    for name in ("greedy", "temperature", "top_k", "top_p", "min_p"):
        mine, theirs = getattr(plain, name), getattr(general, name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    logits = _random_logits(len(params), vocab)
    assert torch.equal(Sampler(3, CPU)(logits, plain).token_ids, Sampler(3, CPU)(logits, general).token_ids)


def test_the_warm_up_batch_uses_every_sampling_feature() -> None:
    """The warm-up launches each device op of the sampler before serving: its rows must reach every
    optional part of a batch (a feature added later and left out of them fails here)."""
    rows = warm_up_rows(8)
    batch = build_sampling_batch(rows, 8, CPU)
    optional = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    assert all(value is not None for value in optional.values()), optional
    assert batch.seeded and batch.max_num_logprobs > 0 and not batch.all_greedy and bool(batch.greedy.any())
    assert all(getattr(rows[0].params, f.name) != f.default for f in dataclasses.fields(SamplingParams)), \
        "a sampling parameter the warm-up leaves at its default"
    out = Sampler(0, CPU, fused=False)(_random_logits(2, 8), batch)
    assert out.top_ids.shape == (2, 5) and out.logprobs.shape == (2,)
    Sampler(0, CPU, fused=False).warm_up(_random_logits(4, 64))  # the plain batches and the rows above


def _packed(allowed: set[int], vocab: int) -> bytes:
    bits = np.zeros(-(-vocab // 8) * 8, dtype=bool)
    bits[sorted(allowed)] = True
    return np.packbits(bits, bitorder="little").tobytes()


def test_token_masks_restrict_masked_rows_only() -> None:
    """Structured output: a masked row samples (greedy: takes the best) among its mask's tokens, the
    bits read little-endian within a byte; a row without a mask in the same batch is untouched."""
    vocab, n = 203, 300  # not a multiple of 8: the mask's last byte is partly padding
    logits = _random_logits(n, vocab, seed=5)
    allowed = {0, 9, 77, 202}
    greedy, drawn = SamplingParams(temperature=0.0, masked=True), SamplingParams(temperature=1.5, masked=True)
    rows = [SamplingRow(p, 0, EMPTY, EMPTY, _packed(allowed, vocab)) for p in (greedy, drawn)] * (n // 3)
    rows += [SamplingRow(SamplingParams(temperature=0.0), 0, EMPTY, EMPTY)] * (n - len(rows))
    out, batch = _sample(logits, rows)
    assert batch.masks is not None and batch.kernel_samples  # temperature and masks: the kernel's, on CUDA
    tokens = out.token_ids.tolist()
    masked = len(rows) - (n - 2 * (n // 3))
    best = [max(allowed, key=lambda t, r=r: logits[r, t].item()) for r in range(0, masked, 2)]
    assert tokens[0:masked:2] == best  # greedy: the best allowed token, not the argmax
    assert set(tokens[1:masked:2]) <= allowed and len(set(tokens[1:masked:2])) > 1  # drawn among them
    assert tokens[masked:] == logits[masked:].argmax(-1).tolist()
    one = _sample(logits[:1], [SamplingRow(greedy, 0, EMPTY, EMPTY, _packed({202}, vocab))])[0]
    assert one.token_ids.tolist() == [202]  # the last id, in the last byte's low bits


def test_rows_that_share_a_mask_get_it_copied_once_and_each_its_own() -> None:
    """A mask object several rows share (TokenMask.same_as) is copied to the device once; each row still
    gets the tokens of its own mask, in row order, beside rows with masks of their own and rows without."""
    vocab = 203
    a, b = _packed({1, 2}, vocab), _packed({7, 202}, vocab)
    copy_of_a = bytes(bytearray(a))  # equal bytes, another object: copied apart
    masks = [a, None, b, a, copy_of_a, a]
    rows = [SamplingRow(SamplingParams(masked=m is not None), 0, EMPTY, EMPTY, m) for m in masks]
    batch = build_sampling_batch(rows, vocab, CPU)
    assert batch.masks.index.tolist() == [0, -1, 1, 0, 2, 0] and batch.masks.packed.shape == (3, len(a))
    wanted = [{1, 2}, set(range(vocab)), {7, 202}, {1, 2}, {1, 2}, {1, 2}]
    assert [set(np.flatnonzero(row.numpy()).tolist()) for row in batch.masks.allowed(vocab)] == wanted


@pytest.mark.parametrize("params, output_pos", [
    (SamplingParams(temperature=0.8, seed=3), 0), (SamplingParams(temperature=0.8, seed=3, masked=True), 0),
    (SamplingParams(temperature=0.8, top_k=5), 0), (SamplingParams(temperature=0.8, top_k=1000), 0),
    (SamplingParams(temperature=0.8, top_p=0.9), 0), (SamplingParams(temperature=0.8, min_p=0.1), 0),
    (SamplingParams(temperature=0.8, presence_penalty=0.5), 0), (SamplingParams(logit_bias=((3, 1.0),)), 0),
    (SamplingParams(min_tokens=2, stop_token_ids=(1,)), 1), (SamplingParams(min_tokens=2, stop_token_ids=(1,)), 2),
])
def test_a_row_the_kernel_takes_alone_is_a_batch_the_kernel_samples(params, output_pos) -> None:
    """The per-row rule that draws a seeded row by the Triton sampler in any batch (``_kernel_takes``)
    agrees with the batch's own (``SamplingBatch.kernel_samples``) for the row alone."""
    from twinplane.dataplane.sampling_batch import _kernel_takes

    row = SamplingRow(params, output_pos, EMPTY, EMPTY)
    assert _kernel_takes(row, 1000) == build_sampling_batch([row], 1000, CPU).kernel_samples
