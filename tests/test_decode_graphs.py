"""Plans of several decode steps, and plans of one decode step at any batch size, replayed by
graphs that sample (``dataplane/decode_graphs.py``) draw the tokens the step-by-step loop draws.

Without a GPU there are no CUDA graphs, so a "replay" runs the recorded step again, on the
graphs' buffers, with the temperature sampler in Triton's interpreter (chosen when a kernel is
decorated: the check runs in a child process). That checks what the graphs hold: the buffers
a plan fills (three sequences in a bucket of four: one padding row; ten in a bucket of
sixteen, above the batch sizes that take plans of several steps), each step reading the
tokens of the step before, and the sampler's keys. The GPU test in test_gpu.py replays real
graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r'''
import sys
from dataclasses import replace

import torch

from tests.test_dp_helpers import PlanBuilder
from twinplane.dataplane.attention_backends.torch_backend import TorchAttentionBackend
from twinplane.dataplane.config import DataPlaneConfig
from twinplane.dataplane.decode_graphs import SampledDecodeGraphs
from twinplane.dataplane.model_runner import ModelRunner
from twinplane.dataplane.plan import SamplingParams, StepPath, StepPlan
from twinplane.dataplane.sampler import Sampler


class LengthsFromTensors(TorchAttentionBackend):
    """Reads a step's lengths from its tensors (a replay changes those, not the host lists);
    rows of context 0 (padding) attend to nothing, as the decode kernel's."""

    def forward(self, q, k_cache, v_cache, metadata, scale):
        lens, queries = metadata.context_lens.tolist(), metadata.cu_seqlens_q.diff().tolist()
        live = [i for i, n in enumerate(lens) if n > 0]
        if len(live) == len(lens):
            metadata = replace(metadata, query_lens_host=queries, context_lens_host=lens)
            return super().forward(q, k_cache, v_cache, metadata, scale)
        assert set(queries) == {1}, "padding rows come in decode steps only"
        out = torch.zeros_like(q)
        metadata = replace(metadata, block_tables=metadata.block_tables[live], query_lens_host=[1] * len(live),
                           context_lens_host=[lens[i] for i in live])
        out[live] = super().forward(q[live], k_cache, v_cache, metadata, scale)
        return out


class Rerun(SampledDecodeGraphs):
    """A replay runs the step again."""

    replays = 0

    def _record(self, step):
        def replay():
            Rerun.replays += 1
            step()
        return replay


BLOCK = 4
PROMPTS = {1: [10, 11, 12, 13, 14], 2: [3, 4, 5], 3: [7, 8, 9, 10, 11, 12, 13]}
TEMPERATURES = (0.0, 0.8, 1.3)
# each sequence's budget; blocks are crossed inside plans; the last plan has more steps than the
# graphs hold (4), so the loop runs it
PLANS = ((4, 1, 3), (2, 4, 4), (5, 2, 5))

runner = ModelRunner(DataPlaneConfig(model=sys.argv[1], block_size=BLOCK, num_kv_blocks=64, max_model_len=64,
                                     max_num_seqs=16, max_num_batched_tokens=64))
for layer in runner.model.attention_layers():
    layer.backend = LengthsFromTensors()
runner.sampler = Sampler(3, runner.device, fused=True)  # the graphs sample with its draw key
graphs = Rerun(runner.model, runner.sampler.draw_key, [1, 2, 4, 8, 16], runner.max_model_len, BLOCK, num_steps=4)
graphs.capture()
assert sorted(graphs.replays) == [(bs, k) for bs in (1, 2, 4, 8) for k in range(4)] + [(16, 0)]


def generate(decode_graphs):
    runner.reset()
    runner.sampler.reseed(3)
    runner.use_decode_graphs(decode_graphs)
    builder = PlanBuilder(BLOCK)
    seqs = [builder.new_seq(i, prompt, SamplingParams(temperature=t))
            for (i, prompt), t in zip(PROMPTS.items(), TEMPERATURES)]
    return builder.generate(runner, seqs, PLANS), int(runner.sampler.draw_key)


looped, looped_draws = generate(None)
assert Rerun.replays == 0
replayed, replayed_draws = generate(graphs)
assert Rerun.replays == 4 + 4, Rerun.replays  # the first two plans
assert replayed == looped, (replayed, looped)
assert replayed_draws == looped_draws  # the key ends where the loop left it: as many draws
assert [len(t) for t in replayed] == [1 + sum(b[i] for b in PLANS) for i in range(3)]
assert all(len(set(tokens)) > len(tokens) // 2 for tokens in replayed), "the model should not repeat a token"


def single_steps(decode_graphs, num_seqs, steps=3, special=(), pending=None):
    """Prefills num_seqs sequences (temperatures cycling; the first ones with the ``special``
    parameters instead), then decodes them one step a plan; with ``pending`` ("all" or "some"),
    the decode token of all or every other sequence is sent as PENDING (-1), as the control plane
    sends it before the previous plan's tokens reach it."""
    runner.reset()
    runner.sampler.reseed(5)
    runner.use_decode_graphs(decode_graphs)
    builder = PlanBuilder(BLOCK)
    prompts = list(PROMPTS.values())
    params = [*special, *(SamplingParams(temperature=TEMPERATURES[i % 3]) for i in range(len(special), num_seqs))]
    seqs = [builder.new_seq(i, prompts[i % 3], params[i]) for i in range(num_seqs)]
    paths = []
    for step in range(steps + 1):
        scheduled = [builder.schedule(s) for s in seqs]
        for i, planned in enumerate(scheduled if step and pending else []):
            if pending == "all" or i % 2:
                planned.token_ids[:] = -1
        out = runner.step(StepPlan(step, scheduled))
        paths.append(out.path)
        for s, token in zip(seqs, out.sampled_token_ids.tolist()):
            s.tokens.append(token)
    return [s.tokens[s.num_prompt_tokens:] for s in seqs], paths


for num_seqs in (3, 10):  # padded to batch sizes 4 (plans of several steps too) and 16 (one step only)
    looped, _ = single_steps(None, num_seqs)
    before = Rerun.replays
    replayed, paths = single_steps(graphs, num_seqs)
    assert Rerun.replays - before == 3, Rerun.replays - before  # every plan after the prompts'
    assert paths[1:] == [StepPath.DECODE_GRAPH] * 3, paths
    assert replayed == looped, (num_seqs, replayed, looped)
    assert num_seqs < 4 or len({tuple(t) for t in replayed[1::3]}) > 1, "rows of one prompt and temperature draw apart"
    for pending in ("all", "some") if num_seqs > 4 else ():  # first tokens gathered from the last plan's
        assert single_steps(graphs, num_seqs, pending=pending) == (replayed, paths), pending

# a seeded row or one that asks for log-probabilities: the step path for the whole plan
for special in ([SamplingParams(temperature=0.8, seed=7)], [SamplingParams(temperature=0.8, num_logprobs=2)]):
    looped, _ = single_steps(None, 3, special=special)
    before = Rerun.replays
    replayed, _ = single_steps(graphs, 3, special=special)
    assert Rerun.replays == before, special
    assert replayed == looped, (special, replayed, looped)
print("decode graphs ok")
'''


def test_decode_graphs_draw_what_the_loop_draws(tiny_llama_dir):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK, str(tiny_llama_dir)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and "decode graphs ok" in result.stdout, result.stderr[-4000:]
