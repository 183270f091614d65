"""How far a float8 KV cache moves a model's next-token distributions from a cache in its own dtype.

    python -m twinplane.dataplane.bench_kv_dtype --model default
    python -m twinplane.dataplane.bench_kv_dtype --model /models/Qwen3-0.6B --tokens 128 --dtype bfloat16

The model answers each prompt greedily with its KV cache in the model's dtype: that is the
reference. A second runner, with ``--kv-cache-dtype`` (fp8 by default), then reads the same
tokens, teacher-forced: at each position its plan holds the reference's token, so both runners
see the same context and their distributions compare position by position. Printed: how often
their top tokens agree, the KL divergence of the second from the reference (nats), and how many
tokens each prompt's greedy answer keeps before the two first part (greedy decoding with the
second cache gives the reference's tokens up to the first position where its top token differs).

A model folder with a tokenizer reads the built-in English prompts; a ``dummy:`` model, which
has none, reads random token ids (its random weights say little about accuracy: use a real one).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import numpy as np
import torch

from twinplane.dataplane.bench_decode import chunk
from twinplane.dataplane.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, DataPlaneConfig
from twinplane.dataplane.plan import StepPlan

MAX_LEN = 2048  # a prompt and its answer

PROMPTS = (
    "The history of the printing press begins in",
    "To make bread at home, you will need flour, water,",
    "Photosynthesis is the process by which plants",
    "The main difference between a list and a tuple in Python is",
    "In 1969, the first people to walk on the Moon",
    "A good way to learn a new language is to",
    "The three laws of thermodynamics state that",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of Australia is not Sydney but",
    "When a star much larger than the Sun runs out of fuel,",
    "Here is a short poem about the sea:\n",
    "The stock market fell sharply on Monday after",
    "To solve the equation 3x + 7 = 22, first",
    "The human heart has four chambers:",
    "Rain forms when water vapour in the air",
    "The rules of chess say that a pawn",
)


@dataclass
class Comparison:
    """Two caches' next-token distributions over the same teacher-forced positions."""

    kl: np.ndarray  # KL(reference || other) in nats at each position, prompt after prompt
    agree: np.ndarray  # whether their top tokens agree there
    kept: list[int]  # for each prompt, the greedy tokens before the first disagreement (all: none)
    tokens: int  # positions a prompt

    def summary(self) -> str:
        kl, kept = self.kl, np.asarray(self.kept)
        return "\n".join([
            f"  top tokens agree at {100 * self.agree.mean():.2f}% of {len(self.agree)} positions (teacher-forced)",
            f"  KL(reference || other), nats a position: mean {kl.mean():.2e}, median {np.median(kl):.2e}, "
            f"p99 {np.quantile(kl, 0.99):.2e}, max {kl.max():.2e}",
            f"  greedy tokens before the first difference: all {self.tokens} in {(kept == self.tokens).sum()} of "
            f"{len(kept)} prompts; median {np.median(kept):.0f}, fewest {kept.min()}"])


def answer(runner, prompt: list[int], tokens: int, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The runner's greedy answer of ``tokens`` tokens to ``prompt`` (teacher-forced by ``forced``:
    its tokens are fed back instead), and the log-probabilities [tokens, vocab] (float32, on the
    host) it gave at each position."""
    block_size = runner.config.block_size
    blocks = list(range(-(-(len(prompt) + tokens) // block_size)))
    plan = StepPlan(0, [chunk(0, np.asarray(prompt), 0, blocks, block_size, True)])
    out, logits = [], []
    for position in range(tokens):
        step, step_logits = runner.step_with_logits(plan)
        logits.append(torch.log_softmax(step_logits[0].float(), dim=-1).cpu())
        token = int(step.sampled_token_ids[0]) if forced is None else forced[position]
        out.append(token)
        plan = StepPlan(position + 1, [chunk(0, np.array([token]), len(prompt) + position, blocks, block_size,
                                             False)])
    runner.reset()
    return out, torch.stack(logits)


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> Comparison:
    """Position by position, prompt after prompt: the other cache's log-probabilities against the reference's."""
    kl, agree, kept = [], [], []
    for ref, oth in zip(reference, other):
        kl.append((ref.exp() * (ref - oth)).sum(-1).clamp(min=0).double().numpy())
        same = (ref.argmax(-1) == oth.argmax(-1)).numpy()
        agree.append(same)
        kept.append(int(np.argmin(same)) if not same.all() else len(same))
    return Comparison(np.concatenate(kl), np.concatenate(agree), kept, len(reference[0]))


def prompt_ids(runner, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts as token ids: the built-in ones through the model's tokenizer (in turn, again
    from the first past the last), or random ids (16-48 of them, in the vocabulary's first 10,000)
    for a model without one."""
    path = runner.loaded.tokenizer_path
    if not path:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, min(10_000, runner.vocab_size), int(rng.integers(16, 49))).tolist()
                for _ in range(count)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False) for i in range(count)]


def measure(config: DataPlaneConfig, kv_cache_dtype: str, prompts: int, tokens: int) -> tuple[str, Comparison]:
    """The reference (``config`` with a cache in the model's dtype) against ``kv_cache_dtype``: a
    heading and the comparison. One runner at a time holds the device."""
    from twinplane.dataplane.model_runner import ModelRunner

    runner = ModelRunner(replace(config, kv_cache_dtype="auto"))
    ids = prompt_ids(runner, prompts)
    described = runner.describe()
    heading = (f"{config.model} ({described.dtype} on {runner.device.type}), {prompts} prompts x {tokens} tokens: "
               f"the cache in {kv_cache_dtype} against the one in {described.kv_cache_dtype}")
    answers = [answer(runner, p, tokens) for p in ids]
    runner.close()
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    runner = ModelRunner(replace(config, kv_cache_dtype=kv_cache_dtype))
    forced = [answer(runner, p, tokens, forced=a[0])[1] for p, a in zip(ids, answers)]
    runner.close()
    return heading, compare([a[1] for a in answers], forced)


def main(argv: list[str] | None = None) -> None:
    from twinplane.dataplane.embedded import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a model folder, 'default' (the embedded model) or dummy:<shape>")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=KV_CACHE_DTYPES,
                   help="the cache compared with one in the model's dtype")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    if args.prompts < 1 or not 1 <= args.tokens <= MAX_LEN // 2:
        p.error(f"--prompts must be at least 1 and --tokens in [1, {MAX_LEN // 2}]")
    config = DataPlaneConfig(model=resolve_model(args.model), device=args.device, dtype=args.dtype,
                             attention_backend=args.attention_backend, block_size=args.block_size, max_num_seqs=1,
                             max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN,
                             num_kv_blocks=-(-MAX_LEN // args.block_size))  # one sequence at a time
    heading, comparison = measure(config, args.kv_cache_dtype, args.prompts, args.tokens)
    print(heading)
    print(comparison.summary())


if __name__ == "__main__":
    main()
