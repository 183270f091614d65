"""ModelRunner against transformers: same logits and greedy tokens on tiny random models.

Each case saves a random transformers model (Qwen3, also with YaRN RoPE; Llama with biases, llama3
RoPE and tied embeddings; Qwen2 with qkv bias; Mistral; one and two safetensors shards), loads it with ModelRunner
and drives full prefill, chunked prefill, decode, a mixed decode + prefill batch and a
prefix-cached prefill, comparing every sampled row with the reference model's logits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tests.test_dp_helpers import DrivenSeq, PlanBuilder
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.plan import PromptLogprobsAsk, StepPlan

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _config(kind: str):
    if kind == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"], tie_word_embeddings=True,
                           attention_bias=True, mlp_bias=True, rope_parameters=rope, rms_norm_eps=1e-5)
    if kind == "qwen3-yarn":  # a context of 16 stretched 4 times: most frequencies interpolated, cos/sin scaled
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
        return Qwen3Config(**COMMON, head_dim=16, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
                           rope_parameters=rope)
    if kind == "mistral":  # no sliding window (as Mistral 7B v0.3's config)
        return MistralConfig(**COMMON, head_dim=16, sliding_window=None, architectures=["MistralForCausalLM"],
                             tie_word_embeddings=False)
    return Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)


def _save_reference(kind: str, folder: Path, sharded: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="300KB" if sharded else "1GB")
    num_files = len(list(folder.glob("*.safetensors")))
    assert num_files >= 2 if sharded else num_files == 1, f"{num_files} safetensors files"
    return model


class Harness:
    def __init__(self, reference: torch.nn.Module, runner: ModelRunner, block_size: int, atol: float = 1e-4) -> None:
        self.reference, self.runner, self.atol = reference, runner, atol
        self.builder = PlanBuilder(block_size)
        self.step_id = 0

    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.reference(torch.tensor([tokens])).logits[0, -1].float()

    def run(self, scheduled: list, sampled_seqs: list[DrivenSeq]) -> None:
        """Run one step; check each sampled row against the reference and append its token."""
        self.step_id += 1
        output, logits = self.runner.step_with_logits(StepPlan(self.step_id, scheduled))
        assert len(output.sampled_token_ids) == len(sampled_seqs)
        for row, seq in enumerate(sampled_seqs):
            expected = self.reference_logits(seq.tokens)
            ours = logits[row].cpu()
            torch.testing.assert_close(ours, expected, atol=self.atol, rtol=self.atol)
            token = int(output.sampled_token_ids[row])
            assert token == int(ours.argmax()) == int(expected.argmax())
            seq.tokens.append(token)


def _prompt(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=generator).tolist()


@pytest.mark.parametrize("kind,block_size,sharded", [
    ("qwen3", 4, False), ("qwen3", 16, True), ("llama", 4, True), ("qwen2", 16, False), ("qwen3-yarn", 4, False),
    ("mistral", 4, False)])
def test_runner_matches_transformers(tmp_path: Path, kind: str, block_size: int, sharded: bool) -> None:
    reference = _save_reference(kind, tmp_path, sharded)
    runner = ModelRunner(DataPlaneConfig(model=str(tmp_path), block_size=block_size, num_kv_blocks=128,
                                         dtype="float32", device="cpu", max_model_len=256))
    assert runner.describe().architecture == _config(kind).architectures[0]
    h, g = Harness(reference, runner, block_size), torch.Generator().manual_seed(1)
    a = h.builder.new_seq(1, _prompt(g, 11))
    h.run([h.builder.schedule(a)], [a])  # full prefill
    b = h.builder.new_seq(2, _prompt(g, 13))
    h.run([h.builder.schedule(b, 7, sample=False)], [])  # chunked prefill, first chunk
    h.run([h.builder.schedule(a), h.builder.schedule(b)], [a, b])  # decode row + last chunk
    for _ in range(4):  # decode both
        h.run([h.builder.schedule(a), h.builder.schedule(b)], [a, b])
    c = h.builder.new_seq(3, _prompt(g, 9))
    h.run([h.builder.schedule(b), h.builder.schedule(c)], [b, c])  # decode row + full prefill row
    full_blocks = 8 // block_size if block_size <= 8 else 0
    shared = a.blocks[:full_blocks] if full_blocks else []
    d = h.builder.new_seq(4, a.tokens[: len(shared) * block_size] + _prompt(g, 5), shared_blocks=shared)
    h.run([h.builder.schedule(d), h.builder.schedule(a)], [d, a])  # prefix-cached prefill + decode


def test_a_sliding_window_shorter_than_the_context_cuts_max_model_len(tmp_path: Path) -> None:
    """Mistral v0.1 attends over a sliding window: the data plane serves at most that many tokens, within
    which attending to all of them is the same (a window that is off, as Qwen2's by default, cuts nothing)."""
    config = MistralConfig(**COMMON, head_dim=16, sliding_window=48, architectures=["MistralForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mistral", safe_serialization=True)
    runner = ModelRunner(DataPlaneConfig(model=str(tmp_path / "mistral"), block_size=4, num_kv_blocks=16,
                                         dtype="float32", device="cpu", max_model_len=256))
    assert runner.max_model_len == 48 and runner.describe().max_model_len == 48
    qwen2 = Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"], sliding_window=48, use_sliding_window=False)
    AutoModelForCausalLM.from_config(qwen2).save_pretrained(tmp_path / "qwen2", safe_serialization=True)
    runner = ModelRunner(DataPlaneConfig(model=str(tmp_path / "qwen2"), block_size=4, num_kv_blocks=16,
                                         dtype="float32", device="cpu", max_model_len=256))
    assert runner.max_model_len == 256


def test_max_model_len_past_the_models_positions_is_cut_to_them_and_said(tmp_path: Path, caplog) -> None:
    """A max_model_len longer than the model has positions for (max_position_embeddings) is cut to them, with
    a log line saying so; a shorter one stays."""
    config = Qwen3Config(**{**COMMON, "max_position_embeddings": 96}, head_dim=16, architectures=["Qwen3ForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)

    def runner(max_model_len: int) -> ModelRunner:
        return ModelRunner(DataPlaneConfig(model=str(tmp_path), block_size=4, num_kv_blocks=16, dtype="float32",
                                           device="cpu", max_model_len=max_model_len))
    with caplog.at_level(logging.INFO, logger="twinplane.dataplane"):
        assert runner(256).describe().max_model_len == 96
    assert "max_model_len is cut from 256 to 96" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="twinplane.dataplane"):
        assert runner(64).describe().max_model_len == 64
    assert "max_model_len is cut" not in caplog.text


def _qwen3_harness(folder: Path) -> Harness:
    """A random Qwen3 saved in folder, and ModelRunner on it (float32, CPU, blocks of 4)."""
    reference = _save_reference("qwen3", folder, sharded=False)
    runner = ModelRunner(DataPlaneConfig(model=str(folder), block_size=4, num_kv_blocks=64,
                                         dtype="float32", device="cpu", max_model_len=256))
    return Harness(reference, runner, 4)


def test_prefix_cache_skips_shared_blocks(tmp_path: Path) -> None:
    """A second sequence reuses two full blocks of the first and computes only its suffix."""
    h, g = _qwen3_harness(tmp_path), torch.Generator().manual_seed(2)
    a = h.builder.new_seq(1, _prompt(g, 10))
    h.run([h.builder.schedule(a)], [a])
    d = h.builder.new_seq(2, a.tokens[:8] + _prompt(g, 3), shared_blocks=a.blocks[:2])
    scheduled = h.builder.schedule(d)
    assert scheduled.start_pos == 8 and scheduled.num_tokens == 3
    h.run([scheduled], [d])
    h.run([h.builder.schedule(d)], [d])  # and one decode step on top


def test_prompt_logprobs_match_transformers(tmp_path: Path) -> None:
    """A prompt in two chunks, the second beside another sequence's decode: the log-probability of each
    prompt token after the first, and the top tokens at each position, are transformers' own."""
    h, g = _qwen3_harness(tmp_path), torch.Generator().manual_seed(3)
    other = h.builder.new_seq(1, _prompt(g, 6))
    h.run([h.builder.schedule(other)], [other])
    seq = h.builder.new_seq(2, _prompt(g, 13))
    tokens = list(seq.tokens)
    first = h.builder.schedule(seq, 5, sample=False)  # its last position scores the second chunk's first token
    first.prompt_logprobs = PromptLogprobsAsk(np.array(tokens[1:6], dtype=np.int32), num_top=3)
    out1 = h.runner.step(StepPlan(10, [first]))
    second = h.builder.schedule(seq)  # positions 5..12: the last one samples, the others score tokens 6..12
    second.prompt_logprobs = PromptLogprobsAsk(np.array(tokens[6:], dtype=np.int32), num_top=2)
    out2 = h.runner.step(StepPlan(11, [h.builder.schedule(other), second]))
    assert list(out1.prompt_logprobs) == [0] and list(out2.prompt_logprobs) == [1]
    with torch.no_grad():
        expected = h.reference(torch.tensor([tokens])).logits[0].float().log_softmax(-1)  # row p scores token p + 1
    for got, rows, k in ((out1.prompt_logprobs[0], range(0, 5), 3), (out2.prompt_logprobs[1], range(5, 12), 2)):
        rows = list(rows)
        want = expected[rows, torch.tensor(tokens[1:])[rows]]
        torch.testing.assert_close(torch.from_numpy(got.logprobs), want, atol=1e-4, rtol=1e-4)
        top = expected[rows].topk(k, dim=-1)
        assert got.top_ids.shape == (len(rows), k) and got.top_ids.tolist() == top.indices.tolist()
        torch.testing.assert_close(torch.from_numpy(got.top_logprobs), top.values, atol=1e-4, rtol=1e-4)
        # 1 + the tokens more likely, give or take those the float rounding of the two models could swap with it
        # (within 1e-5 of it: the token itself among them, so they count it)
        fewest, most = ((expected[rows] > torch.from_numpy(got.logprobs)[:, None] + eps).sum(-1) + one
                        for eps, one in ((1e-5, 1), (-1e-5, 0)))
        ranks = torch.from_numpy(got.ranks)
        assert ((fewest <= ranks) & (ranks <= most)).all() and ranks.max() > k  # random weights: many far down
    assert int(out2.sampled_token_ids[1]) == int(expected[12].argmax())
