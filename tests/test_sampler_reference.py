"""The sampler's filters against Hugging Face transformers' own logits processors.

For random logits (ties and round values included, where the boundary rules of top_k and top_p
decide) and random logit bias / temperature / top_k / top_p / min_p / repetition penalty, the
tokens the sampler may draw must be exactly those that the reference chain leaves a probability
above 0: transformers' SequenceBias (as logit_bias), RepetitionPenalty, Temperature, MinP, TopK
and TopP processors, in the sampler's (and vLLM's) order. Where tied tokens straddle a top_p
boundary, which of them stays is the sort's choice (in transformers as here), so rows are
compared as the logits they keep, with multiplicity. And every draw must come from the tokens kept.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinplane.dataplane.plan import SamplingParams
from twinplane.dataplane.sampler import Sampler, adjust_logits, filter_logits
from twinplane.dataplane.sampling_batch import SamplingRow, build_sampling_batch

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

CPU = torch.device("cpu")
PROPERTY = settings(max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
EMPTY = np.empty(0, dtype=np.int32)

# logits often of a few round values, so ties and probabilities that sum exactly to a top_p
# boundary are common (log 2 apart: probabilities 1/2, 1/4, 1/8, ...)
logit_rows = st.integers(2, 12).flatmap(
    lambda vocab: st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0]).map(lambda k: float(k * np.log(2)))
                                    | st.floats(-4, 4, width=32), min_size=vocab, max_size=vocab),
                           min_size=1, max_size=4))
params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.5, 1.0, 2.0]) | st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, 1, 2, 3]) | st.integers(0, 16),
    top_p=st.sampled_from([1.0, 0.5, 0.75, 0.25]) | st.floats(0.0625, 1.0, width=32),
    min_p=st.sampled_from([0.0, 0.5]) | st.floats(0.0, 0.9375, width=32),
    repetition_penalty=st.sampled_from([1.0, 2.0]) | st.floats(0.5, 3.0),
)


def _reference_kept(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> list[bool]:
    """The tokens transformers' processors leave a probability above 0 (in float32), in the sampler's order."""
    ids = torch.tensor([history or [0]], dtype=torch.long)
    scores = logits.unsqueeze(0).clone()
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], v] for t, v in p.logit_bias])(ids, scores)
    if p.repetition_penalty != 1.0 and history:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if 0 < p.top_k < logits.shape[-1]:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return (scores[0].softmax(-1) > 0).tolist()


@PROPERTY
@given(rows=logit_rows, data=st.data())
def test_the_sampler_keeps_the_tokens_transformers_keeps(rows: list[list[float]], data) -> None:
    logits = torch.tensor(rows, dtype=torch.float32)
    n, vocab = logits.shape
    biases = st.dictionaries(st.integers(0, vocab - 1), st.sampled_from([-100.0, -2.5, 1.0, 3.0, 100.0])
                             | st.floats(-100, 100, width=32), max_size=3)
    row_params = [replace(data.draw(params), logit_bias=tuple(sorted(data.draw(biases).items()))) for _ in range(n)]
    histories = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=4)) for _ in range(n)]
    batch_rows = [SamplingRow(p, 0, np.asarray(h, np.int32), EMPTY) for p, h in zip(row_params, histories)]
    batch = build_sampling_batch(batch_rows, vocab, CPU)
    kept = (filter_logits(adjust_logits(logits, batch), batch).softmax(-1) > 0).tolist()
    for i in range(n):
        reference = _reference_kept(logits[i], row_params[i], histories[i])
        mine, theirs = ([x for x, k in zip(rows[i], mask) if k] for mask in (kept[i], reference))
        assert sorted(mine) == sorted(theirs), (rows[i], row_params[i], histories[i])
    sampler = Sampler(data.draw(st.integers(0, 2**31)), CPU)
    draws = sampler(logits.repeat(8, 1), build_sampling_batch(batch_rows * 8, vocab, CPU))
    for j, token in enumerate(draws.token_ids.tolist()):
        assert kept[j % n][token], f"row {j % n} drew token {token}, which its filters remove"


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """Two tokens share the second-highest logit: top_k=2 keeps both, as transformers and vLLM do,
    rather than the one with the lower id."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    batch = build_sampling_batch([SamplingRow(SamplingParams(top_k=2), 0, EMPTY, EMPTY)], 4, CPU)
    assert torch.isfinite(filter_logits(logits, batch)).tolist() == [[True, True, True, False]]


def test_top_p_stops_at_the_token_that_reaches_it() -> None:
    """Probabilities 1/2, 1/4, 1/8, 1/8: top_p 0.75 is reached by the first two tokens exactly, so the
    third goes; top_p 0.5 by the first alone."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.5, 0.25, 0.125, 0.125]]))
    rows = [SamplingRow(SamplingParams(top_p=p), 0, EMPTY, EMPTY) for p in (0.75, 0.5)]
    kept = torch.isfinite(filter_logits(logits, build_sampling_batch(rows, 4, CPU))).tolist()
    assert kept == [[True, True, False, False], [True, False, False, False]]


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
                               SamplingParams(temperature=1.3, top_p=0.7),
                               SamplingParams(temperature=0.5, min_p=0.2, seed=5)],
                         ids=["every-filter", "top-p", "min-p-seeded"])
def test_draws_follow_the_reference_distribution(p: SamplingParams) -> None:
    """20,000 draws of one row's token (fixed seeds: the counts are the same every run) against the
    softmax of what transformers' processors leave: every token within 4.5 standard deviations."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    n = 20_000
    rows = [SamplingRow(p, i if p.seed is not None else 0, EMPTY, EMPTY) for i in range(n)]  # seeded: n positions
    drawn = Sampler(0, CPU)(logits.repeat(n, 1), build_sampling_batch(rows, len(logits), CPU)).token_ids
    kept = torch.tensor(_reference_kept(logits, p, []))
    scaled = (logits / p.temperature).masked_fill(~kept, float("-inf"))
    expected = scaled.softmax(-1).double()
    frequencies = torch.bincount(drawn, minlength=len(logits)).double() / n
    assert (frequencies[~kept] == 0).all(), f"drew removed tokens: {frequencies.tolist()}"
    sigma = (expected * (1 - expected) / n).sqrt().clamp(min=1e-12)
    z = ((frequencies - expected).abs() / sigma)[kept]
    assert z.max() < 4.5, f"frequencies {frequencies.tolist()} against {expected.tolist()}"
