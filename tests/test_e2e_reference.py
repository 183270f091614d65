"""Greedy outputs through both planes equal transformers' own models (float32, CPU)."""

from __future__ import annotations

import random

import grpc
import pytest
import torch
import transformers

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me one tip for learning to code.",
]


def hf_greedy(folder, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool, **generate_kwargs) -> list[int]:
    model = _hf_model(str(folder))
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    extra.update(generate_kwargs)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **extra)
    return out[0, len(prompt_ids):].tolist()


_models: dict[str, transformers.PreTrainedModel] = {}


def _hf_model(folder: str):
    if folder not in _models:
        _models[folder] = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return _models[folder]


def random_prompts(n: int, seed: int, low: int = 3, high: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_random_models_match_transformers(arch, request, planes_factory):
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    planes = planes_factory(folder, "--block-size", "16")
    with planes.client() as client:
        for prompt in random_prompts(4, seed=7):
            got = [t for c in client.generate(token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True)
                   for t in c.token_ids]
            assert got == hf_greedy(folder, prompt, 12, ignore_eos=True)


def test_repetition_penalty_matches_transformers(tiny_qwen3_dir, shared_planes):
    """Greedy with a repetition penalty equals transformers' generate with its own penalty processor
    (over prompt and output), also when the prompt's full blocks come from the prefix cache."""
    changed = 0
    with shared_planes.client() as client:
        for i, (start, tail) in enumerate(zip(random_prompts(3, seed=13, low=16, high=16),
                                              random_prompts(3, seed=14, low=8, high=12))):
            # the model's own continuation in the prompt's first blocks (the ones the cache serves the
            # second time): the tokens it would pick next are prompt tokens
            prompt = start + hf_greedy(tiny_qwen3_dir, start, 16, ignore_eos=True) + tail
            expected = hf_greedy(tiny_qwen3_dir, prompt, 16, ignore_eos=True, repetition_penalty=1.6)
            free = hf_greedy(tiny_qwen3_dir, prompt, 16, ignore_eos=True)
            changed += expected != free
            for attempt in ("computed", "cached"):
                chunks = list(client.generate(token_ids=prompt, max_tokens=16, temperature=0, ignore_eos=True,
                                              repetition_penalty=1.6))
                assert [t for c in chunks for t in c.token_ids] == expected, (i, attempt)
            assert chunks[-1].usage.cached_prompt_tokens == 32, "the second time, two blocks came from the cache"
            strong = hf_greedy(tiny_qwen3_dir, prompt, 16, ignore_eos=True, repetition_penalty=8.0)  # past 2, as vLLM
            changed += strong != free
            assert [t for c in client.generate(token_ids=prompt, max_tokens=16, temperature=0, ignore_eos=True,
                                               repetition_penalty=8.0) for t in c.token_ids] == strong, i
    assert changed >= 2, "the penalties changed too few reference outputs: the test would not notice them ignored"


def test_logit_bias_matches_transformers(tiny_qwen3_dir, shared_planes):
    """Greedy with logit_bias equals transformers' generate with the same biases (its sequence_bias
    of one-token sequences), with a repetition penalty applied after them as both do."""
    changed = 0
    with shared_planes.client() as client:
        for prompt in random_prompts(3, seed=17):
            free = hf_greedy(tiny_qwen3_dir, prompt, 12, ignore_eos=True)
            bias = {free[0]: -0.5, free[4]: -2.0, free[8]: 0.75, 4321: 1.5}  # mild: the model still decides
            for penalty in (1.0, 1.3):
                expected = hf_greedy(tiny_qwen3_dir, prompt, 12, ignore_eos=True, repetition_penalty=penalty,
                                     sequence_bias=[[[t], v] for t, v in bias.items()])
                changed += expected != free
                got = [t for c in client.generate(token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True,
                                                  repetition_penalty=penalty, logit_bias=bias)
                       for t in c.token_ids]
                assert got == expected, (prompt, penalty)
    assert changed >= 2, "the biases changed too few reference outputs to show they are applied"


def test_logprobs_match_transformers(tiny_qwen3_dir, shared_planes):
    """The log-probabilities streamed (the sampled token's and the top 5) equal transformers'
    log_softmax at each generated position, for a sampled (seeded) and a greedy request."""
    model = _hf_model(str(tiny_qwen3_dir))
    with shared_planes.client() as client:
        for prompt, temperature in zip(random_prompts(2, seed=23), (0.0, 0.9)):
            chunks = list(client.generate(token_ids=prompt, max_tokens=8, temperature=temperature, seed=4,
                                          ignore_eos=True, logprobs=5))
            tokens = [t for c in chunks for t in c.token_ids]
            positions = [p for c in chunks for p in c.logprobs]
            assert len(positions) == len(tokens) == 8
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            reference = logits.float().log_softmax(-1)
            for i, (token, position) in enumerate(zip(tokens, positions)):
                assert position.token_id == token
                assert abs(position.logprob - reference[i, token].item()) < 1e-3, (i, position.logprob)
                top_values = reference[i].topk(5).values.tolist()
                assert [lp for _, lp in position.top] == pytest.approx(top_values, abs=1e-3), i
                for token_id, lp in position.top:
                    assert abs(lp - reference[i, token_id].item()) < 1e-3, (i, token_id)


def test_prompt_logprobs_match_transformers(tiny_qwen3_dir, planes_factory):
    """prompt_logprobs: each prompt token's log-probability after the first, and the top 3 at each position,
    equal transformers' log_softmax, for a prompt computed in three chunks; a prompt whose blocks are in the
    prefix cache is computed whole again for them."""
    model = _hf_model(str(tiny_qwen3_dir))
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", max_num_batched_tokens=24)
    prompt = random_prompts(1, seed=29, low=50, high=50)[0]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    with planes.client() as client:
        client.generate_text(token_ids=prompt, max_tokens=1)  # its full blocks join the prefix cache
        chunks = list(client.generate(token_ids=prompt, max_tokens=3, temperature=0, ignore_eos=True,
                                      prompt_logprobs=3, logprobs=0))
    assert chunks[-1].usage.cached_prompt_tokens == 0
    scored = chunks[0].prompt_logprobs
    assert [p.token_id for p in scored] == prompt[1:]
    assert all(not c.prompt_logprobs for c in chunks[1:]), "they come with the first message only"
    for i, position in enumerate(scored):
        assert abs(position.logprob - reference[i, prompt[i + 1]].item()) < 1e-3, i
        # 1 + the tokens more likely, give or take those the float rounding of the two models could swap with it
        # (within 1e-5 of it: the token itself among them, so they count it)
        fewest, most = ((reference[i] > position.logprob + eps).sum().item() + one
                        for eps, one in ((1e-5, 1), (-1e-5, 0)))
        assert fewest <= position.rank <= most, (i, position.rank, fewest, most)
        top = reference[i].topk(3)
        assert [t for t, _ in position.top] == top.indices.tolist(), i
        assert [lp for _, lp in position.top] == pytest.approx(top.values.tolist(), abs=1e-3), i
    first = chunks[0].logprobs[0]  # the first output's own log-probability is the last prompt position's
    assert first.token_id == int(reference[-1].argmax()) and abs(first.logprob - reference[-1].max().item()) < 1e-3


def test_smollm2_chat_matches_transformers(smollm2_dir, planes_factory):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    planes = planes_factory(smollm2_dir)
    with planes.client() as client:
        for text in CHAT_PROMPTS:
            messages = [{"role": "user", "content": text}]
            chunks = list(client.generate(messages=messages, max_tokens=24, temperature=0))
            got = [t for c in chunks for t in c.token_ids]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert chunks[-1].usage.prompt_tokens == len(ids)
            assert got == hf_greedy(smollm2_dir, list(ids), 24, ignore_eos=False), text
            if text.startswith("What is the capital"):
                assert "Paris" in "".join(c.text for c in chunks)


def test_min_tokens_matches_transformers_min_new_tokens(smollm2_dir, planes_factory):
    """A chat answer that ends early, asked for more: min_tokens masks the end-of-sequence tokens as
    transformers' min_new_tokens does, and the answer then ends where transformers' ends."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    planes = planes_factory(smollm2_dir)
    messages = [{"role": "user", "content": "What is 12 times 12?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with planes.client() as client:
        free = list(client.generate(messages=messages, max_tokens=64, temperature=0))
        natural = free[-1].usage.completion_tokens
        assert free[-1].finish_reason == "stop_token" and natural < 48, natural
        longer = list(client.generate(messages=messages, max_tokens=64, min_tokens=natural + 4, temperature=0))
    got = [t for c in longer for t in c.token_ids]
    expected = hf_greedy(smollm2_dir, ids, 64, ignore_eos=False, min_new_tokens=natural + 4)
    assert len(got) >= natural + 4 and got == expected


def test_allowed_token_ids_restrict_every_token_to_them(tiny_qwen3_dir, planes_factory):
    """allowed_token_ids: greedy output is transformers' argmax over those ids alone, token after token (their
    mask goes in every plan, the token in flight or not); a sampled request draws only among them."""
    model = _hf_model(str(tiny_qwen3_dir))
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    prompt = random_prompts(1, seed=31, low=20, high=20)[0]
    allowed = [7, 100, 2_000, 30_000, 49_151]  # the last id of the vocabulary too
    with planes.client() as client:
        greedy = [t for c in client.generate(token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True,
                                             allowed_token_ids=allowed) for t in c.token_ids]
        drawn = [t for c in client.generate(token_ids=prompt, max_tokens=40, temperature=1.5, ignore_eos=True,
                                            allowed_token_ids=allowed, seed=5) for t in c.token_ids]
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([expected])).logits[0, -1]
            expected.append(max(allowed, key=lambda t: logits[t].item()))
    assert greedy == expected[len(prompt):]
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1 and len(drawn) == 40


def test_constraints_together_keep_to_all_of_them(tiny_qwen3_dir, planes_factory):
    """allowed_token_ids with bad_words: greedy output is transformers' argmax over the allowed ids less the
    banned ones; with a regex as well, over the allowed ids that keep to it. Where they leave no token at
    all the request fails, naming them, and the server goes on serving."""
    from twinplane.controlplane.tokenizer import Tokenizer

    model, tokenizer = _hf_model(str(tiny_qwen3_dir)), Tokenizer(tiny_qwen3_dir)
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    prompt = random_prompts(1, seed=37, low=20, high=20)[0]
    digits = [tokenizer.encode(d)[0] for d in "0123456789"]
    letter = tokenizer.encode("x")[0]

    def reference(allowed: list[int], n: int) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([prompt + out])).logits[0, -1]
                out.append(max(allowed, key=lambda t: logits[t].item()))
        return out

    def generate(**kwargs) -> list[int]:
        chunks = client.generate(token_ids=prompt, max_tokens=10, temperature=0, **kwargs)
        return [t for c in chunks for t in c.token_ids]

    with planes.client() as client:
        free = generate(allowed_token_ids=digits + [letter])
        first = tokenizer.token_texts(free[:1])[0]  # the free output's first token, banned: the output changes
        banned = generate(allowed_token_ids=digits + [letter], bad_words=[first])
        low = generate(allowed_token_ids=digits + [letter], regex="[0-4]+")
        with pytest.raises(grpc.RpcError) as error:
            generate(allowed_token_ids=[letter], regex="[0-4]+")
        assert generate(allowed_token_ids=digits) == reference(digits, 10)  # still serving
    assert free == reference(digits + [letter], 10)
    assert banned == reference([t for t in digits + [letter] if t != free[0]], 10) and banned != free
    assert low == reference(digits[:5], 10) and set(tokenizer.decode(low)) <= set("01234")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allowed_token_ids and structured output leave no token to write next" in error.value.details()


def test_bad_words_are_never_written(tiny_qwen3_dir, planes_factory):
    """bad_words, as vLLM reads them: a word of one token is never generated, a longer word's last token never
    right after the rest of it. Greedy output equals transformers' argmax over the tokens those rules leave,
    token after token; the words are taken from the output itself, so that each ban changes it."""
    from twinplane.controlplane.structured import bad_words_ids
    from twinplane.controlplane.tokenizer import Tokenizer

    model, tokenizer = _hf_model(str(tiny_qwen3_dir)), Tokenizer(tiny_qwen3_dir)
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16")
    prompt = "The quick brown fox"

    def generate(words):
        return [t for c in client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, bad_words=words)
                for t in c.token_ids]

    with planes.client() as client:
        free = generate([])
        single = [tokenizer.token_texts(free[:1])[0]]
        first = generate(single)  # without the free output's first token
        texts = tokenizer.token_texts(first)
        # two tokens of that output that are one word's (their text tokenizes back to them): a word to ban
        pair = next(texts[i] + texts[i + 1] for i in range(1, 10)
                    if (first[i], first[i + 1]) in bad_words_ids(tokenizer, [texts[i] + texts[i + 1]]))
        banned = generate(single + [pair])
    ids = bad_words_ids(tokenizer, single + [pair])
    prompt_ids, out = tokenizer.encode(prompt), []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].clone()
            for word in ids:  # one token: always; longer: its last right after the rest of it in the output
                if len(word) == 1 or len(out) >= len(word) - 1 and tuple(out[len(out) - len(word) + 1:]) == word[:-1]:
                    logits[word[-1]] = -torch.inf
            out.append(int(logits.argmax()))
    assert banned == out and first != free and banned != first
