"""The float8 cache's accuracy benchmark: teacher-forced comparison of two KV caches."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from twinplane.dataplane.bench_kv_dtype import compare, main, measure, prompt_ids
from twinplane.dataplane.config import DataPlaneConfig


def _config(model_dir) -> DataPlaneConfig:
    return DataPlaneConfig(model=str(model_dir), device="cpu", block_size=4, max_num_seqs=1,
                           max_num_batched_tokens=256, max_model_len=256, num_kv_blocks=64)


def test_compare_gives_kl_agreement_and_the_first_difference() -> None:
    half, skewed = math.log(0.5), [math.log(0.25), math.log(0.75)]
    reference = torch.tensor([[math.log(0.9), math.log(0.1)], [half, half], [math.log(0.9), math.log(0.1)]])
    other = torch.tensor([[math.log(0.9), math.log(0.1)], skewed, skewed])
    result = compare([reference, reference[:2]], [other, other[:2]])
    kl_second = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    kl_third = 0.9 * math.log(0.9 / 0.25) + 0.1 * math.log(0.1 / 0.75)
    assert result.kl.tolist() == pytest.approx([0.0, kl_second, kl_third, 0.0, kl_second], abs=1e-6)
    # a tie goes to the first token (argmax), as the sampler's greedy pick does
    assert result.agree.tolist() == [True, False, False, True, False]
    assert result.kept == [1, 1]
    assert "40.00% of 5 positions" in result.summary()


def test_a_model_without_a_tokenizer_reads_random_ids_in_its_vocabulary() -> None:
    runner = SimpleNamespace(loaded=SimpleNamespace(tokenizer_path=""), vocab_size=50)
    ids = prompt_ids(runner, 5)
    assert len(ids) == 5 and all(16 <= len(p) <= 48 for p in ids)
    assert all(0 <= t < 50 for p in ids for t in p) and len({tuple(p) for p in ids}) == 5
    assert prompt_ids(runner, 5) == ids  # seeded


def test_the_same_cache_twice_agrees_everywhere(tiny_llama_dir) -> None:
    _, result = measure(_config(tiny_llama_dir), "auto", prompts=2, tokens=6)
    assert result.kl.tolist() == [0.0] * 12
    assert result.agree.all() and result.kept == [6, 6]


def test_a_float8_cache_moves_the_distributions_a_little(tiny_llama_dir) -> None:
    heading, result = measure(_config(tiny_llama_dir), "fp8", prompts=2, tokens=6)
    assert "the cache in fp8 against the one in float32" in heading
    assert len(result.kl) == 12 and result.kl.max() > 0  # the reads went through the float8 cache
    assert np.all(result.kl < 1.0)  # rounding, not another model


def test_the_command_prints_its_figures(tiny_llama_dir, capsys) -> None:
    main(["--model", str(tiny_llama_dir), "--device", "cpu", "--prompts", "1", "--tokens", "3", "--block-size", "4"])
    out = capsys.readouterr().out
    assert "1 prompts x 3 tokens" in out and "of 3 positions" in out and "KL(reference || other)" in out
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_llama_dir), "--tokens", "0"])


def test_a_teacher_forced_answer_reads_the_forced_tokens(tiny_llama_dir) -> None:
    from twinplane.dataplane.bench_kv_dtype import answer
    from twinplane.dataplane.model_runner import ModelRunner

    runner = ModelRunner(_config(tiny_llama_dir))
    prompt, forced = [5, 17, 230, 9], [301, 302, 303, 304]
    greedy, _ = answer(runner, prompt, 4)
    assert greedy != forced
    tokens, log_probs = answer(runner, prompt, 4, forced=forced)
    assert tokens == forced
    # position 2 follows prompt + forced[:2], as a prompt of those tokens does
    _, fresh = answer(runner, prompt + forced[:2], 1)
    torch.testing.assert_close(log_probs[2], fresh[0], atol=1e-4, rtol=1e-4)
    runner.close()
