"""The OpenAI-compatible HTTP API, through the official openai client and raw HTTP, on both planes."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import socket
import ssl
import time
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest

from tests.conftest import Planes
from tests.reliability import all_blocks_free, wait_until
from twinplane.controlplane import openai_http
from twinplane.controlplane.main import Security
from twinplane.controlplane.tokenizer import ChatOptions, Tokenizer

KEY = "sk-test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word, then explain."}]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # several full KV blocks of 16 tokens
NAMES = ("twinplane/tiny-qwen3", "tiny")  # --served-model-name: the first reported, with a slash in it


@pytest.fixture(scope="module")
def http_planes(tiny_qwen3_dir, tmp_path_factory):
    planes = Planes(tmp_path_factory.mktemp("http"), tiny_qwen3_dir, ("--block-size", "16"),
                    security=Security(api_key=KEY), http_listen="127.0.0.1:0", served_model_names=NAMES).start()
    yield planes
    planes.stop()


@pytest.fixture(scope="module")
def base_url(http_planes) -> str:
    return f"http://127.0.0.1:{http_planes.plane.http_port}"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(http_planes) -> str:
    return NAMES[0]


def grpc_text(planes: Planes, **kwargs) -> str:
    with planes.client(api_key=KEY) as grpc_client:
        return grpc_client.generate_text(**kwargs, timeout=60)


def test_models_lists_the_served_model_under_each_name(client, model, http_planes, tiny_qwen3_dir):
    listed = client.models.list().data
    assert [m.id for m in listed] == list(NAMES) and {m.root for m in listed} == {str(tiny_qwen3_dir)}
    assert all(0 < time.time() - m.created < 3600 for m in listed)  # when the server began serving it
    assert client.models.retrieve(model).id == model  # a slash in the id
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    assert error.value.code == "model_not_found" and "'twinplane/tiny-qwen3', 'tiny'" in error.value.message
    with pytest.raises(openai.NotFoundError):  # the data plane's own name is not one of the served names
        client.chat.completions.create(model=str(tiny_qwen3_dir), messages=QUESTION, max_tokens=1)
    with http_planes.client(api_key=KEY) as grpc_client:
        assert grpc_client.model_info().model == model


def test_a_response_names_the_model_as_asked(client, base_url):
    alias = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    assert alias.model == "tiny"
    unnamed = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                         headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == NAMES[0]


def test_chat_greedy_text_equals_the_grpc_text(client, model, http_planes):
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    expected = grpc_text(http_planes, messages=QUESTION, max_tokens=24, temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    assert answer.object == "chat.completion" and answer.model == model and answer.id.startswith("chatcmpl-")
    assert answer.usage.completion_tokens <= 24
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_chat_stream_with_usage(client, model, http_planes):
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc_text(http_planes, messages=QUESTION, max_tokens=20, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_every_chunk_its_choices_counts_so_far(base_url, model):
    """stream_options.continuous_usage_stats, as vLLM's: each chunk's usage counts the prompt and the tokens of
    its choice so far (0 in a chat's role chunk); with include_usage too, a last chunk has the usage alone."""
    headers = {"authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/chat/completions", {"messages": QUESTION, "logprobs": True}),
                       ("/v1/completions", {"prompt": "Once upon a time", "logprobs": 0})):
        for include_usage in (True, False):
            options = {"continuous_usage_stats": True, "include_usage": include_usage}
            request = {**body, "model": model, "max_tokens": 7, "n": 2, "temperature": 1.0, "seed": 5,
                       "ignore_eos": True, "stream": True, "stream_options": options}
            with httpx.stream("POST", base_url + path, json=request, headers=headers, timeout=60) as reply:
                lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
            final = chunks.pop() if include_usage else None
            assert final is None or final["choices"] == [] and final["usage"]["completion_tokens"] == 14
            prompt_tokens = {chunk["usage"]["prompt_tokens"] for chunk in chunks}
            assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0
            drawn = {0: 0, 1: 0}  # tokens of each choice so far, by its chunks' logprobs
            for chunk in chunks:
                (choice,) = chunk["choices"]
                logprobs = choice["logprobs"] or {}
                drawn[choice["index"]] += len(logprobs.get("content") or logprobs.get("tokens") or [])
                usage = chunk["usage"]
                assert usage["completion_tokens"] == drawn[choice["index"]], (path, chunk)
                assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert drawn == {0: 7, 1: 7}


def test_chat_stream_of_several_choices_begins_each_with_its_role_alone(client, model):
    """Each choice's first chunk is its role and empty content, no log-probabilities (as OpenAI's and vLLM's):
    the SDK's stream helper, which takes a choice's first chunk as its start, then counts each token once."""
    kwargs = dict(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=1.0, seed=3, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert (mine[0].delta.role, mine[0].delta.content, mine[0].logprobs) == ("assistant", "", None)
        assert all(c.delta.role is None for c in mine[1:])
        assert sum(len(c.logprobs.content) for c in mine[1:] if c.logprobs) == 6
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.current_completion_snapshot  # (get_final_completion refuses a choice cut by length)
    assert [len(choice.logprobs.content) for choice in final.choices] == [6, 6]


def test_completions_stream_and_not_equal_the_grpc_text(client, model, http_planes):
    expected = grpc_text(http_planes, prompt="Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == expected


def test_completions_from_token_ids(client, model, http_planes):
    ids = list(range(100, 120))
    expected = grpc_text(http_planes, token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
    answer = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected and answer.usage.prompt_tokens == len(ids)


def test_a_prompt_too_long_is_truncated_when_asked(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=[5] * 5000, max_tokens=2)
    assert "truncate_prompt_tokens" in error.value.message  # the advice the next request follows
    assert "400 - prompt: the prompt has 5000 tokens" in error.value.message and error.value.param == "prompt"
    answer = client.completions.create(model=model, prompt=[5] * 5000, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 100})
    assert answer.usage.prompt_tokens == 100


def test_n_choices_share_the_prompt_blocks(client, model, http_planes):
    hits_before = http_planes.engine.core_snapshot.prefix_cache_hits
    answer = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, seed=7,
                                       n=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in answer.choices)
    assert answer.usage.completion_tokens == 36
    assert len({c.text for c in answer.choices}) > 1  # each choice draws with a seed of its own
    full_blocks = answer.usage.prompt_tokens // 16 * 16
    assert http_planes.engine.core_snapshot.prefix_cache_hits - hits_before >= 2 * min(full_blocks, 64)
    again = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, seed=7,
                                      n=3, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]  # seeded: reproducible


def test_n_choices_stream_with_indexes(client, model):
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, seed=3, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}


def test_a_batch_of_prompts_answers_each_as_alone(client, model, http_planes):
    """A completion's prompt may be a batch (texts and token ids): choice p * n + j belongs to prompt p,
    each prompt's choices are what it gets alone (seeded), and usage counts each prompt once."""
    prompts = ["Once upon a time", list(range(100, 120)), LONG_PROMPT]
    kwargs = dict(model=model, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, n=2, **kwargs) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    texts = {c.index: c.text for c in batch.choices}
    for p, answer in enumerate(alone):
        assert [texts[2 * p + c.index] for c in answer.choices] == [c.text for c in answer.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 36
    stream = client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                       **kwargs)
    streamed, finished, usage = {0: "", 1: "", 2: ""}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and [streamed[p] for p in range(3)] == [a.choices[0].text for a in alone]
    assert usage.prompt_tokens == batch.usage.prompt_tokens and usage.completion_tokens == 18
    wait_until(lambda: all_blocks_free(http_planes), 20, "every KV block free after the batch")


def test_echo_starts_each_choice_with_its_prompt(client, base_url, model, http_planes):
    """echo: a text prompt as sent; token ids (or a truncated text) as the text of the tokens the model
    got; streamed, the prompt comes in the choice's first chunk."""
    kwargs = dict(model=model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(prompt="Once upon a time", **kwargs)
    plain = alone.choices[0].text
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kwargs).choices[0].text
    assert echoed == "Once upon a time" + plain
    ids = list(range(100, 120))
    shown = http_planes.engine.tokenizer.decode(ids, skip_special_tokens=False)
    batch = client.completions.create(prompt=["Once upon a time", ids], n=2, echo=True, **kwargs)
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] == echoed and texts[2] == texts[3] and texts[2].startswith(shown)
    assert len(texts[2]) > len(shown) and batch.usage.prompt_tokens == alone.usage.prompt_tokens + len(ids)
    stream = client.completions.create(prompt=["Once upon a time", ids], echo=True, stream=True, **kwargs)
    firsts, streamed = {}, {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.text)
            streamed[c.index] += c.text
    assert firsts[0].startswith("Once upon a time") and firsts[1].startswith(shown)
    assert streamed == {0: texts[0], 1: texts[2]}
    tail = httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": LONG_PROMPT},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()["tokens"][-10:]
    truncated = client.completions.create(prompt=LONG_PROMPT, echo=True, **{**kwargs, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 10}})
    assert truncated.choices[0].text.startswith(http_planes.engine.tokenizer.decode(tail, skip_special_tokens=False))
    assert truncated.usage.prompt_tokens == 10


def test_echo_with_logprobs_scores_the_prompt(client, model, tiny_qwen3_dir):
    """echo with logprobs (how evaluation harnesses score a text): each choice's log-probabilities start with
    the prompt's, transformers' own, its first token's null; every choice of the prompt has the same ones,
    and streamed they come in the choice's first chunk."""
    import torch
    import transformers

    ids = list(range(300, 340, 2))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    kwargs = dict(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})
    batch = client.completions.create(n=2, **kwargs)
    first, second = (c.logprobs for c in sorted(batch.choices, key=lambda c: c.index))
    assert first.token_logprobs[:len(ids)] == second.token_logprobs[:len(ids)]
    assert len(first.tokens) == len(ids) + 2 and first.token_logprobs[0] is None and first.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(first.token_logprobs[i] - expected[i - 1, ids[i]].item()) < 1e-3, i
        top = expected[i - 1].topk(2).values.tolist()
        scored = first.top_logprobs[i]  # the prompt's token first, then the top 2 (up to 3, as OpenAI's)
        assert next(iter(scored.values())) == first.token_logprobs[i] and 2 <= len(scored) <= 3, i
        assert sorted(scored.values(), reverse=True)[:2] == pytest.approx(top, abs=1e-3), i
    assert abs(first.token_logprobs[len(ids)] - expected[-1].max().item()) < 1e-3  # the first output, greedy
    assert first.text_offset == sorted(first.text_offset) and first.text_offset[0] == 0
    chunks = [c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices]
    assert chunks[0].logprobs.token_logprobs[:len(ids)] == first.token_logprobs[:len(ids)]
    assert sum(len(c.logprobs.tokens) for c in chunks) == len(ids) + 2


def _check_prompt_logprobs(scored: list, ids: list[int], expected, top: int, tokenizer) -> None:
    """vLLM's prompt_logprobs against transformers' log_softmax (expected: row p scores token p + 1): null for
    the first token, then the prompt token's log-probability and rank and the top ones, each with its text."""
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        position, row = scored[i], expected[i - 1]
        mine = position[str(ids[i])]
        assert abs(mine["logprob"] - row[ids[i]].item()) < 1e-3, i
        fewest, most = ((row > mine["logprob"] + eps).sum().item() + one for eps, one in ((1e-5, 1), (-1e-5, 0)))
        assert fewest <= mine["rank"] <= most, (i, mine, fewest, most)
        best = row.topk(top)
        for rank, (token_id, logprob) in enumerate(zip(best.indices.tolist(), best.values.tolist()), 1):
            entry = position[str(token_id)]
            assert abs(entry["logprob"] - logprob) < 1e-3 and entry["rank"] == rank, (i, rank)
        assert len(position) == top + (str(ids[i]) not in map(str, best.indices.tolist())), i
        assert all(e["decoded_token"] == tokenizer.token_texts([int(t)])[0] for t, e in position.items())


def test_prompt_logprobs_as_vllm_gives_them(client, base_url, model, tiny_qwen3_dir, http_planes):
    """vLLM's prompt_logprobs: every choice of a completion carries its prompt's (transformers' own, with
    ranks), beside echo's own view of them with fewer top tokens; a chat completion carries its prompt's
    beside its choices; streamed or past max_logprobs they are refused with a message."""
    import torch
    import transformers

    ids = list(range(300, 340, 2))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    tokenizer = http_planes.engine.tokenizer
    whole = client.completions.create(model=model, prompt=ids, max_tokens=2, n=2, echo=True, logprobs=1,
                                      extra_body={"prompt_logprobs": 3})
    for choice in whole.choices:
        _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, expected, 3, tokenizer)
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs[1:]), "echo's view: its token, top 1"
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    prompt = httpx.post(f"{base_url}/tokenize", json={"model": model, "messages": QUESTION},
                        headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()["tokens"]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    _check_prompt_logprobs(chat.model_extra["prompt_logprobs"], prompt, expected, 0, tokenizer)
    assert len(prompt) == chat.usage.prompt_tokens
    for kwargs, message in ((dict(stream=True), "prompt_logprobs is not available with stream: true"),
                            (dict(extra_body={"prompt_logprobs": 21}), r"prompt_logprobs must be in \[0, 20\]")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=model, prompt=ids, max_tokens=2,
                                      **{"extra_body": {"prompt_logprobs": 1}, **kwargs})


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client, model, http_planes):
    """vLLM's return_tokens_as_token_ids: logprobs name each token (and each top one) "token_id:<id>", the ids
    of the tokens the same greedy request names by their text; in completions (whole and streamed) and chat."""
    tokenizer = http_planes.engine.tokenizer
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    by_text = client.completions.create(**kwargs).choices[0].logprobs
    by_id = client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in by_id.tokens]
    assert all(token.startswith("token_id:") for token in by_id.tokens)
    assert tokenizer.token_texts(ids) == by_text.tokens and by_id.token_logprobs == by_text.token_logprobs
    assert [tokenizer.token_texts([int(t.removeprefix("token_id:")) for t in top]) for top in by_id.top_logprobs] \
        == [list(top) for top in by_text.top_logprobs]
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"return_tokens_as_token_ids": True})
    assert [t for chunk in streamed for c in chunk.choices for t in c.logprobs.tokens] == by_id.tokens
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.token.startswith("token_id:") and t.bytes == list(t.token.encode()) for t in chat.content)


def test_allowed_token_ids_restrict_the_tokens(client, model, http_planes):
    """vLLM's allowed_token_ids: every generated token (its text, in logprobs) is one of them, in completions
    and chat; an empty list is refused with a message."""
    allowed = [300, 301, 1_000, 2_000]
    texts = set(http_planes.engine.tokenizer.token_texts(allowed))
    extra = {"allowed_token_ids": allowed, "ignore_eos": True}
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, logprobs=0,
                                           temperature=1.0, extra_body=extra)
    assert len(completion.choices[0].logprobs.tokens) == 16 and set(completion.choices[0].logprobs.tokens) <= texts
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, logprobs=True,
                                          extra_body=extra)
    assert {t.token for t in chat.choices[0].logprobs.content} <= texts
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids must not be empty"):
        client.completions.create(model=model, prompt="Once", max_tokens=2, extra_body={"allowed_token_ids": []})


def test_bad_words_keep_a_word_out(client, model, http_planes):
    """vLLM's bad_words over HTTP: a word the free output writes (one token) is not written with it banned."""
    from twinplane.controlplane.structured import bad_words_ids

    tokenizer = http_planes.engine.tokenizer
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0)
    free = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    # vLLM's reading of a word: its tokens alone, and after a space only when that makes as many tokens
    word = next(token for token in free if token.strip() and
                tuple(tokenizer.encode(token, add_special_tokens=False)) in bad_words_ids(tokenizer, [token]))
    banned = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "bad_words": [word]})
    assert word not in banned.choices[0].logprobs.tokens and banned.choices[0].logprobs.tokens != free
    with pytest.raises(openai.BadRequestError, match="bad_words must be a list of strings"):
        client.completions.create(**kwargs, extra_body={"bad_words": "word"})


def test_echo_with_max_tokens_0_gives_the_prompt_alone(client, model, http_planes):
    """echo with max_tokens 0 scores a text: the prompt and its log-probabilities, nothing generated (the
    token drawn after it is dropped), as a whole response and streamed."""
    ids = list(range(300, 340, 2))
    shown = http_planes.engine.tokenizer.decode(ids, skip_special_tokens=False)
    kwargs = dict(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.text == shown and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert None not in choice.logprobs.token_logprobs[1:]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 0)
    chunks = [c for chunk in client.completions.create(stream=True, **kwargs) for c in chunk.choices]
    assert "".join(c.text for c in chunks) == shown and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens must be in"):
        client.completions.create(model=model, prompt=ids, max_tokens=0)  # without echo there is nothing to show


def test_logprobs(client, model):
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4  # greedy took the most likely one
    text = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    # the sampled token comes first among its top ones, always (OpenAI's "up to logprobs + 1")
    assert all(list(top.items())[0] == (token, logprob)
               for top, token, logprob in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    sampled = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=1.5, seed=3,
                                        logprobs=0, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert sampled.top_logprobs == [{token: logprob} for token, logprob in zip(sampled.tokens, sampled.token_logprobs)]


def test_stop_string(client, model):
    """A stop string ends the text before it; vLLM's stop_reason names it (null for the length), in the
    response and in a stream's last chunk, chat's too."""
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    free = whole.text
    assert whole.finish_reason == "length" and whole.model_extra["stop_reason"] is None
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert stop.strip(), free
    cut = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]
    assert cut.model_extra["stop_reason"] == stop
    streamed = [c.choices[0] for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True})]
    assert streamed[-1].model_extra["stop_reason"] == stop
    assert not any("stop_reason" in c.model_extra for c in streamed[:-1])  # outputs merged or not
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
    said = chat.choices[0].message.content
    ended = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                           temperature=0, stop=[said[4:7]], extra_body={"ignore_eos": True})
    assert ended.choices[0].model_extra["stop_reason"] == said[4:7], said
    assert chat.choices[0].model_extra["stop_reason"] is None
    kept = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == free[:free.index(stop) + len(stop)]


def test_include_stop_str_in_output_keeps_a_stop_tokens_text_too(client, model):
    """As vLLM's: the text of a stop_token_ids token that ended the request is kept with the flag, else left out."""
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=0)
    ids = [int(t.removeprefix("token_id:")) for t in client.completions.create(
        **kwargs, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs.tokens]
    texts = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k] and texts[k].strip()
             and "\ufffd" not in "".join(texts[:k + 1]))  # a token seen first there, whole characters up to it
    for keep in (False, True):
        choice = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]],
                                                                 "include_stop_str_in_output": keep}).choices[0]
        assert choice.finish_reason == "stop" and choice.text == "".join(texts[:k + keep]), (keep, texts, k)
        assert choice.model_extra["stop_reason"] == ids[k]  # vLLM's: the stop token's id


def test_logit_bias_forces_bans_and_leaves_logprobs_alone(client, model, http_planes):
    """OpenAI's logit_bias (token ids as JSON keys): +100 makes greedy decoding emit that token, -100
    keeps the greedy choice out, and the log-probabilities reported stay the model's own."""
    forced = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.8, seed=1,
                                       logprobs=0, logit_bias={"123": 100},
                                       extra_body={"ignore_eos": True}).choices[0]
    same = dict(token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    assert grpc_tokens(http_planes, **same, logit_bias={123: 100.0}) == [123] * 6
    assert forced.text == grpc_text(http_planes, **same, logit_bias={123: 100.0})
    assert all(lp < -1 for lp in forced.logprobs.token_logprobs), forced.logprobs  # the model's own, not ~0
    greedy = grpc_tokens(http_planes, token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0, ignore_eos=True)
    banned = grpc_tokens(http_planes, token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0, ignore_eos=True,
                         logit_bias={t: -100.0 for t in greedy})
    assert not set(banned) & set(greedy), (greedy, banned)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="Hi", logit_bias={"123": 500})
    assert "logit_bias[123] must be in [-100.0, 100.0]" in error.value.message and error.value.param == "logit_bias"


def test_chat_template_options_over_both_apis(client, base_url, model, http_planes, tiny_qwen3_dir):
    """add_generation_prompt and continue_final_message (a reply begun for the model) reach the chat
    template through HTTP and gRPC alike, in /tokenize and in completions; the ids are the local
    tokenizer's for the same options, and the two flags together are refused."""
    tok = Tokenizer(tiny_qwen3_dir)
    begun = [*QUESTION, {"role": "assistant", "content": "Paris. It is"}]
    cases = [({"add_generation_prompt": False}, QUESTION),
             ({"chat_template_kwargs": {"enable_thinking": False}}, QUESTION),
             ({"add_generation_prompt": False, "continue_final_message": True}, begun)]
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        with http_planes.client(api_key=KEY) as grpc_client:
            for options, messages in cases:
                expected = tok.encode_chat(messages, options=ChatOptions(
                    options.get("add_generation_prompt", True), options.get("continue_final_message", False),
                    options.get("chat_template_kwargs", {})))
                assert http.post("/tokenize", json={"messages": messages, **options}).json()["tokens"] == expected
                assert grpc_client.tokenize(messages=messages, **options) == expected
            assert expected[-3:] != tok.encode_chat(begun)[-3:]  # continued: no closed turn, no new one
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(model=model, messages=begun, max_tokens=8, temperature=0,
                                            extra_body=continued)
    assert answer.choices[0].message.content == grpc_text(http_planes, messages=begun, max_tokens=8, temperature=0,
                                                          **continued)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=begun, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert error.value.param == "continue_final_message" and "add_generation_prompt false" in error.value.message
    with pytest.raises(grpc.RpcError) as failed:
        grpc_text(http_planes, messages=QUESTION, max_tokens=1, chat_template_kwargs={"eos_token": "x"})
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.chat_template_kwargs may not set eos_token" in failed.value.details()


def test_chat_echo_starts_the_reply_with_the_message_it_goes_on_from(client, model, http_planes):
    """Chat echo, as vLLM's: the reply's content starts with the last message's when that message has the
    reply's role (the assistant's after a generation prompt, else the last message's own), whole and in a
    chunk of its own after the role's; otherwise it changes nothing. The tokens are those without echo."""
    begun = [*QUESTION, {"role": "assistant", "content": "Paris. It is"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    kwargs = dict(model=model, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(messages=begun, extra_body=continued, **kwargs).choices[0].message
    echoed = client.chat.completions.create(messages=begun, extra_body={**continued, "echo": True}, n=2, **kwargs)
    assert [c.message.content for c in echoed.choices] == ["Paris. It is" + plain.content] * 2
    assert {c.message.role for c in echoed.choices} == {"assistant"} and echoed.usage.completion_tokens == 12
    stream = client.chat.completions.create(messages=begun, extra_body={**continued, "echo": True}, stream=True,
                                            **kwargs)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert (deltas[0].role, deltas[0].content) == ("assistant", "")
    assert deltas[1].content == "Paris. It is" and deltas[1].role is None
    assert "".join(d.content or "" for d in deltas) == "Paris. It is" + plain.content
    asked = client.chat.completions.create(messages=QUESTION, extra_body={"echo": True, "ignore_eos": True}, **kwargs)
    assert asked.choices[0].message.content == client.chat.completions.create(
        messages=QUESTION, extra_body={"ignore_eos": True}, **kwargs).choices[0].message.content  # a user's: none
    own = client.chat.completions.create(messages=QUESTION, extra_body={"add_generation_prompt": False, "echo": True,
                                                                        "ignore_eos": True}, **kwargs)
    assert own.choices[0].message.role == "user" and own.choices[0].message.content.startswith(QUESTION[-1]["content"])


def test_tokenize_and_detokenize_as_vllm_serves_them(base_url, model, http_planes):
    """POST /tokenize (a text prompt, or chat messages with the generation prompt) gives the ids the
    gRPC Tokenize gives; POST /detokenize turns ids back into text; bad bodies get 400 naming the field."""
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as http:
        with http_planes.client(api_key=KEY) as grpc_client:
            for body, grpc_kwargs in (({"prompt": "Hello there, world"}, {"text": "Hello there, world"}),
                                      ({"model": model, "messages": QUESTION}, {"messages": QUESTION})):
                answer = http.post("/tokenize", json=body).json()
                expected = grpc_client.tokenize(**grpc_kwargs)
                assert answer["tokens"] == expected and answer["count"] == len(expected) > 0
                assert answer["max_model_len"] == http_planes.engine.limits.max_model_len
        ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Once upon a time"}
        chat = http.post("/tokenize", json={"model": model, "messages": QUESTION}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": chat}).json()["prompt"]  # special tokens kept, as vLLM's
        assert text == http_planes.engine.tokenizer.render_chat(QUESTION) and "<|im_start|>" in text
        for path, body, words in (("/tokenize", {"prompt": [1, 2]}, "prompt is required: a string"),
                                  ("/tokenize", {"messages": "hi"}, "messages is required"),
                                  ("/detokenize", {"tokens": "hi"}, "tokens is required"),
                                  ("/detokenize", {"tokens": [10**9]}, "tokens must be in [0, ")):
            reply = http.post(path, json=body)
            assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
        assert http.post("/tokenize", json={"prompt": "x"}, headers={"authorization": "Bearer no"}).status_code == 401


def grpc_tokens(planes: Planes, **kwargs) -> list[int]:
    with planes.client(api_key=KEY) as grpc_client:
        return [t for chunk in grpc_client.generate(**kwargs, timeout=60) for t in chunk.token_ids]


def test_errors_through_the_sdk(base_url, client, model, http_planes):
    with pytest.raises(openai.AuthenticationError) as error:
        openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert error.value.status_code == 401 and error.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=QUESTION, temperature=-1)
    assert "temperature must be" in error.value.message and error.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt="Hi", max_tokens=100_000)
    assert "max_tokens" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    assert "messages[0].role" in error.value.message
    # checks made once the prompt is tokenized name the field the client sent, too
    limit = http_planes.engine.limits.max_model_len
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=QUESTION, max_completion_tokens=limit)
    assert "400 - max_completion_tokens: prompt (" in error.value.message, error.value.message
    assert "set max_completion_tokens <=" in error.value.message and error.value.param == "max_completion_tokens"


def test_sse_framing_over_raw_http(base_url, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base_url + "/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(response.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[len("data: "):])["object"] == "chat.completion.chunk"


def test_bad_json_gets_400_and_leaks_nothing(base_url):
    secret = "s3cr3t-payload-do-not-echo"
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
        bodies = ('{"messages": [{"role": "user", "content": "' + secret, f'["{secret}"]',
                  b"\xff\xfe" + secret.encode())
        for body in bodies:
            response = http.post(base_url + "/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
            assert secret not in response.text and "Traceback" not in response.text
        response = http.get(base_url + "/v1/nowhere")
        assert response.status_code == 404 and "error" in response.json()
        assert http.get(base_url + "/health").json() == {"status": "SERVING"}


def test_version_answers_without_a_key(base_url):
    """GET /version, as vLLM's: the installed package's version, to a client with no API key."""
    response = httpx.get(base_url + "/version", timeout=30)
    assert response.status_code == 200 and response.json() == {"version": importlib.metadata.version("twinplane")}


def test_bodies_json_cannot_hold_get_400(base_url):
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
        for body, words, param in (
                ("[" * 100_000, "nests", None), ('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", "number", None),
                ('{"prompt": "hi \\ud800"}', "prompt is not valid Unicode", "prompt"),
                ('{"prompt": "hi", "model": [' + ",".join(["[]"] * 1000) + "]}", "model must be a string", "model")):
            response = http.post(base_url + "/v1/completions", content=body,
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"]
            assert error["param"] == param


def test_a_large_body_is_parsed_off_the_event_loop(base_url, model, monkeypatch):
    """A body past THREAD_PARSE_BYTES is parsed on a tokenizer thread (12 MB of token ids take ~0.1 s, which
    would stall every stream the frontend serves meanwhile), a small one on the event loop; both answer alike,
    and a large body that is not JSON is still a 400."""
    where = []

    def recording(data):
        try:
            asyncio.get_running_loop()
            where.append((len(data), "event loop"))
        except RuntimeError:  # no event loop runs in this thread
            where.append((len(data), "thread"))
        return json.loads(data)

    monkeypatch.setattr(openai_http, "json", SimpleNamespace(loads=recording, dumps=json.dumps,
                                                             JSONDecodeError=json.JSONDecodeError))
    headers = {"authorization": f"Bearer {KEY}"}
    small = {"model": model, "prompt": [21] * 8, "max_tokens": 4, "temperature": 0}
    large = {**small, "prompt": [21] * 8, "user": "u" * openai_http.THREAD_PARSE_BYTES}
    with httpx.Client(timeout=60, headers=headers) as http:
        texts = [http.post(base_url + "/v1/completions", json=body).json()["choices"][0]["text"]
                 for body in (small, large)]
        broken = http.post(base_url + "/v1/completions", content=b"{" + b" " * openai_http.THREAD_PARSE_BYTES,
                           headers={"content-type": "application/json"})
    assert texts[0] == texts[1]
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    assert [kind for _, kind in where] == ["event loop", "thread", "thread"], where
    assert where[0][0] <= openai_http.THREAD_PARSE_BYTES < where[1][0]


def test_odd_values_get_a_4xx_saying_what_is_allowed(base_url, model):
    """Values that once reached code that could not take them (a 500, or a stream left hanging) get a client
    error that says what was wrong; the server keeps serving."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"\ud800": {"type": "banana"}}}}}
    cases = [  # (raw JSON body, status, param, words of the message)
        ('{"prompt": "Hi", "logit_bias": {"--5": 1}}', 400, "logit_bias", "keys must be token ids"),
        ('{"prompt": "Hi", "logit_bias": {"\u0661\u0662": 1}}', 400, "logit_bias", "keys must be token ids"),
        ('{"prompt": "Hi", "temperature": 1' + "0" * 400 + "}", 400, "temperature", "must be a finite number"),
        ('{"prompt": "Hi", "logit_bias": {"5": 1' + "0" * 400 + "}}", 400, "logit_bias", "logit_bias[5]"),
        ('{"prompt": "Hi", "bad_words": ["\\ud800"]}', 400, "bad_words", "bad_words[0] is not valid Unicode"),
        ('{"prompt": "Hi", "stop": ["\\ud800"]}', 400, "stop", "stop[0] is not valid Unicode"),
        (json.dumps({"prompt": "Hi", "response_format": schema}), 400, "response_format", "properties.\\ud800"),
        ('{"prompt": "Hi", "stream": true, "stream_options": {"include_usage": "no"}}', 400, "stream_options",
         "stream_options.include_usage must be true or false"),
        ('{"prompt": "Hi", "ignore_eos": "yes"}', 400, "ignore_eos", "ignore_eos must be true or false"),
    ]
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(timeout=30, headers=headers) as http:
        for body, status, param, words in cases:
            body = body.replace('"Hi"', f'"Hi", "model": "{model}"')
            response = http.post(base_url + "/v1/completions", content=body)
            error = response.json()["error"]
            assert response.status_code == status and words in error["message"], (body[:80], response.text)
            assert error["param"] == param, (body[:80], error)
        response = http.post(base_url + "/v1/completions", content=b" " * (16 << 20) + b"{}")
        assert response.status_code == 413 and "over 16777216 bytes" in response.json()["error"]["message"]
        response = http.get(base_url + "/v1/chat/completions")
        assert response.status_code == 405 and "GET is not allowed on /v1/chat/completions; use POST" in response.text
        response = http.get(base_url + "/v1/nowhere")
        assert response.status_code == 404 and "/v1/nowhere is not a route" in response.json()["error"]["message"]
        assert http.get(base_url + "/health").json() == {"status": "SERVING"}


def test_fields_clients_send_at_their_defaults_are_taken(base_url, model):
    """A body as vLLM's own request models dump it (every field, most at its default: top_logprobs 0 without
    logprobs, vLLM's whole structured_outputs) and the neutral values of OpenAI's clients get an answer."""
    vllm = {"frequency_penalty": 0.0, "logit_bias": None, "n": 1, "presence_penalty": 0.0, "seed": None, "stop": [],
            "stream": False, "stream_options": None, "temperature": None, "top_p": None, "user": None,
            "best_of": None, "use_beam_search": False, "top_k": None, "min_p": None, "repetition_penalty": None,
            "length_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False,
            "min_tokens": 0, "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "truncate_prompt_tokens": None, "prompt_logprobs": None, "allowed_token_ids": None, "priority": 0,
            "response_format": None, "return_tokens_as_token_ids": None, "cache_salt": None, "vllm_xargs": None}
    chat = {**vllm, "messages": QUESTION, "logprobs": False, "top_logprobs": 0, "max_completion_tokens": None,
            "tools": None, "tool_choice": "none", "reasoning_effort": None, "parallel_tool_calls": True,
            "bad_words": [], "echo": False, "add_generation_prompt": True, "continue_final_message": False,
            "chat_template_kwargs": None}
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    structured = {"json": schema, "regex": None, "choice": None, "grammar": None, "json_object": None,
                  "structural_tag": None, "disable_fallback": False, "disable_any_whitespace": False,
                  "disable_additional_properties": False, "whitespace_pattern": None, "_backend": None,
                  "_backend_was_auto": False}
    neutral = {"store": False, "service_tier": "auto", "metadata": {}, "user": "u", "stop": None, "n": 1,
               "response_format": {"type": "text"}, "prediction": None, "modalities": ["text"]}
    requests = [("chat/completions", {**chat, "max_tokens": 3}),
                ("chat/completions", {**chat, "max_tokens": 32, "structured_outputs": structured}),
                ("chat/completions", {"messages": QUESTION, "max_completion_tokens": 3, **neutral}),
                ("completions", {**vllm, "prompt": "Hello", "logprobs": None, "max_tokens": 3, "suffix": None,
                                 "echo": False, "add_special_tokens": True, "structured_outputs": None})]
    with httpx.Client(timeout=60, headers={"authorization": f"Bearer {KEY}"}) as http:
        answers = []
        for path, body in requests:
            response = http.post(f"{base_url}/v1/{path}", json={"model": model, **body})
            assert response.status_code == 200, (path, response.text)
            answers.append(response.json()["choices"][0])
    assert [answer["logprobs"] for answer in answers] == [None] * 4
    assert json.loads(answers[1]["message"]["content"]) in ({"answer": "yes"}, {"answer": "no"}), answers[1]


def test_request_ids_need_not_be_unique(base_url, model, http_planes):
    """A request id is the client's label, not a key: requests that share one with a request in flight (a
    retry, another client's choice, the choices of a request of several) run beside it, each stream with
    its own tokens under the id it was given."""
    def tokens(grpc_client, **kwargs) -> tuple[list[int], set[str]]:
        chunks = list(grpc_client.generate("Hi", max_tokens=4, temperature=0, ignore_eos=True, timeout=60, **kwargs))
        return [t for chunk in chunks for t in chunk.token_ids], {chunk.request_id for chunk in chunks}

    with http_planes.client(api_key=KEY) as grpc_client:
        running = grpc_client.generate(LONG_PROMPT, max_tokens=3000, ignore_eos=True, request_id="dup-1")
        next(iter(running))
        same_id, ids = tokens(grpc_client, request_id="dup-1")
        assert len(same_id) == 4 and ids == {"dup-1"}
        for header in ("dup", "dup-1"):  # n=2 makes the choices "dup-0" and "dup-1" in the logs
            headers = {"authorization": f"Bearer {KEY}", "x-request-id": header}
            both = httpx.post(base_url + "/v1/completions", headers=headers, timeout=60,
                              json={"model": model, "prompt": "Once upon a time", "max_tokens": 4, "n": 2})
            assert both.status_code == 200 and len(both.json()["choices"]) == 2, both.text
            assert both.headers["x-request-id"] == header
        # a non-ASCII id in UTF-8: the response's id holds its text, the header its UTF-8 percent-encoded once
        headers = {"authorization": f"Bearer {KEY}", "x-request-id": "réq-1".encode()}
        named = httpx.post(base_url + "/v1/completions", headers=headers, timeout=60,
                           json={"model": model, "prompt": "Once upon a time", "max_tokens": 2})
        assert named.status_code == 200 and named.json()["id"] == "cmpl-réq-1", named.text
        assert named.headers["x-request-id"] == "r%C3%A9q-1"
        assert len(next(iter(running)).token_ids) > 0  # the first one still streams
        running.cancel()
    wait_until(lambda: all_blocks_free(http_planes), 20, "every KV block free")


def test_values_the_data_plane_cannot_take_get_400_and_spare_other_requests(base_url, model, http_planes):
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60, headers=headers) as http:
        with http.stream("POST", base_url + "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")
            # an int32 and 32-bit floats on the data plane: out of range, or 0 where 0 is not allowed
            for bad in ({"top_k": 2**31}, {"top_p": 1e-300}, {"repetition_penalty": 1e-300}):
                response = http.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **bad})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == next(iter(bad))
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and all("error" not in e for e in events)
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert http.get(base_url + "/health").json() == {"status": "SERVING"}
    wait_until(lambda: all_blocks_free(http_planes), 20, "every KV block free")


def test_disconnect_mid_stream_frees_the_blocks(base_url, model, http_planes):
    metrics = http_planes.engine.metrics
    tokens_before, aborted_before = metrics.generation_tokens, metrics.finished["aborted"]
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base_url + "/v1/completions", json=body,
                         headers={"authorization": f"Bearer {KEY}"}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert http_planes.free_blocks()[0] < http_planes.free_blocks()[1]
    wait_until(lambda: all_blocks_free(http_planes), 20, "every KV block free after the client left")
    assert metrics.finished["aborted"] == aborted_before + 1  # ended by the disconnect, not max_tokens
    assert metrics.generation_tokens > tokens_before  # HTTP requests count in the same metrics


def _leave_a_whole_response_once_it_runs(base_url: str, model: str, planes: Planes) -> None:
    """Asks for a long whole (not streamed) response and closes the connection, as a client that stops waiting
    does, once its tokens come: on that event, not after a time (its 3,000 tokens take 5 s on an idle 2-core
    machine, 1 s on one five times as fast)."""
    body = json.dumps({"model": model, "prompt": LONG_PROMPT, "max_tokens": 3000, "ignore_eos": True}).encode()
    generated = planes.engine.metrics.generation_tokens
    with socket.create_connection(("127.0.0.1", int(base_url.rpartition(":")[2])), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        wait_until(lambda: planes.engine.metrics.generation_tokens > generated, 60, "the request's first tokens")


def test_disconnect_while_waiting_for_a_whole_response_aborts(base_url, model, http_planes):
    aborted_before = http_planes.engine.metrics.finished["aborted"]
    _leave_a_whole_response_once_it_runs(base_url, model, http_planes)
    wait_until(lambda: all_blocks_free(http_planes), 20, "every KV block free after the client left")
    assert http_planes.engine.metrics.finished["aborted"] == aborted_before + 1


def test_a_whole_response_left_by_its_client_leaves_nothing_waiting_for_its_outputs(base_url, model, http_planes):
    """Once the client went away and the request was aborted, no task is left collecting outputs that never come."""
    import asyncio

    _leave_a_whole_response_once_it_runs(base_url, model, http_planes)

    async def collecting() -> int:
        return sum(task.get_coro().__qualname__.endswith(".collect") for task in asyncio.all_tasks())

    wait_until(lambda: all_blocks_free(http_planes) and http_planes.call(collecting()) == 0, 20,
               "every KV block free and no task collecting outputs after the client left")


def test_503_without_a_data_plane(tmp_path):
    planes = Planes(tmp_path, "unused", http_listen="127.0.0.1:0")
    planes.start_controlplane()  # no data plane ever answers
    try:
        url = f"http://127.0.0.1:{planes.plane.http_port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as error:
            client.chat.completions.create(model="any", messages=QUESTION)
        assert error.value.status_code == 503 and "no data plane is connected yet" in error.value.message
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    finally:
        planes.stop()


def test_a_request_refused_while_not_serving_is_told_why():
    from twinplane.controlplane.config import ControlPlaneConfig
    from twinplane.controlplane.engine import Engine
    from twinplane.proto import dataplane_pb2 as dp

    engine = Engine(ControlPlaneConfig(dataplane="unix:///nowhere"))
    assert not engine.serving and engine.why_not_serving() == "no data plane is connected yet; retry later"
    engine._connected = True
    engine._set_stalled("data plane", True)
    assert not engine.serving and engine.why_not_serving() == "the data plane stalled; retry later"
    engine._set_stalled("data plane", False)
    assert engine.serving
    engine._replay, engine._connected = True, False  # as when the engine core died
    assert engine.why_not_serving() == "the engine core is restarting; retry later"
    engine._replay, engine.describe = False, dp.DescribeResponse()  # one was connected, and lost
    assert engine.why_not_serving() == "no data plane is connected: it was lost, and the control plane reconnects; " \
        "retry later"
    engine.accepting = False
    assert not engine.serving and engine.why_not_serving() == "the server is shutting down"


def test_429_when_too_many_wait_and_shutdown_ends_streams(planes_factory, tiny_qwen3_dir):
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-num-seqs", "1", max_waiting_requests=1,
                            http_listen="127.0.0.1:0")
    url = f"http://127.0.0.1:{planes.plane.http_port}/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body) as running:
            running_lines = running.iter_lines()
            assert next(running_lines).startswith("data: ")  # running: the one sequence a step may hold
            with http.stream("POST", url, json=body) as waiting:
                wait_until(lambda: planes.engine.num_waiting == 1, 10, "the second request to wait")
                refused = http.post(url, json={**body, "stream": False})
                assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
                planes.call(planes.plane.shutdown(grace=0))  # what SIGTERM does
                for lines in (running_lines, waiting.iter_lines()):
                    events = [line for line in lines if line]
                    assert events[-1] == "data: [DONE]"
                    assert "shut down" in json.loads(events[-2][len("data: "):])["error"]["message"]
    planes.plane = None  # already shut down


def test_the_room_for_every_choice_is_checked_before_the_first_runs(planes_factory, tiny_qwen3_dir):
    """A request's choices (its prompts times n) are admitted or refused together, before any of them runs: the
    later choices, added once the first has cached the prompt, were refused part way (429 after the first ran)
    or waited behind it. More choices than max_waiting_requests allows can never fit: 400."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", "--max-num-seqs", "1", max_waiting_requests=2,
                            http_listen="127.0.0.1:0")
    url = f"http://127.0.0.1:{planes.plane.http_port}/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    too_many = httpx.post(url, json={**body, "stream": False, "n": 3, "max_tokens": 2}, timeout=30)
    assert too_many.status_code == 400 and "asks for 3 sequences (its prompts times n); max_waiting_requests 2 " \
        "allows at most 2 at once" in too_many.json()["error"]["message"], too_many.text
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url, json=body) as running:
            assert next(running.iter_lines()).startswith("data: ")  # running: the one sequence a step may hold
            with http.stream("POST", url, json=body):
                wait_until(lambda: planes.engine.num_waiting == 1, 10, "the second request to wait")
                refused = http.post(url, json={**body, "stream": False, "n": 2, "max_tokens": 2}, timeout=10)
                assert refused.status_code == 429 and "max_waiting_requests 2" in refused.json()["error"]["message"]
                assert planes.engine.num_waiting == 1  # none of its choices was added


def test_a_batch_refused_part_way_leaves_nothing_behind(planes_factory, tiny_qwen3_dir):
    """A batch whose later prompt is refused once tokenized (too long) gets 400, and none of its prompts is
    added: none is left to run, none counts as aborted, no KV block is taken, and a batch that fits runs next."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", http_listen="127.0.0.1:0")
    url = f"http://127.0.0.1:{planes.plane.http_port}/v1/completions"
    body = {"prompt": ["Once upon a time", [5, 6, 7], "The quick brown fox " * 5000, [8, 9]], "max_tokens": 512,
            "ignore_eos": True}
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 400 and "the prompt has" in refused.json()["error"]["message"], refused.text
    assert not planes.engine.requests  # not left to run their 512 tokens
    assert planes.engine.metrics.finished["aborted"] == 0  # the client was told 400: no prompt of it ran
    wait_until(lambda: planes.engine.num_waiting == 0 and all_blocks_free(planes), 20,
               "no request waiting and every KV block free after the refused batch")
    answer = httpx.post(url, json={**body, "prompt": body["prompt"][:2], "max_tokens": 4}, timeout=60).json()
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1] and answer["usage"]["completion_tokens"] == 8


def test_tls_files_serve_the_http_api_over_https(tmp_path):
    from tests.test_reliability_security import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    planes = Planes(tmp_path, "unused", http_listen="127.0.0.1:0", listen="127.0.0.1:0",
                    security=Security(tls_cert=str(cert), tls_key=str(key)))
    planes.start_controlplane()  # no data plane: health answers 503, over TLS
    try:
        port = planes.plane.http_port
        trusted = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=30).status_code == 503
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)  # plaintext is refused
    finally:
        planes.stop()


def test_a_streamed_response_is_closed_on_the_event_loop(base_url, model, http_planes, monkeypatch):
    """The requests of a streamed response are closed (aborted if still running) on the event loop that owns
    them, not on one of the server's worker threads."""
    import threading

    from twinplane.controlplane.openai_stream import Choices

    threads, close = [], Choices.close
    monkeypatch.setattr(Choices, "close", lambda self: (threads.append(threading.get_ident()), close(self)))
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "stream": True, "n": 2}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200 and "data: [DONE]" in response.read().decode()
    # closed where its outputs end, where its event stream ends and by the response's background task
    wait_until(lambda: len(threads) == 3, 10, "the response's three closes")

    async def loop_thread() -> int:
        return threading.get_ident()

    assert set(threads) == {http_planes.call(loop_thread())}
