"""Property-based test of the OpenAI-compatible HTTP API: random combinations of parameters, one server.

Every request is greedy (temperature 0), so its output is deterministic. Hypothesis draws the endpoint
(/v1/completions or /v1/chat/completions), the prompt (fixed texts, random text, token ids), n (1-4),
max_tokens (or max_completion_tokens), ignore_eos, logprobs (completions: 0-5; chat: true with
top_logprobs 0-5), stop strings (substrings of the output without them, so that they occur, or random
ones), stream_options.include_usage and, for completions, echo (max_tokens 0 then too). Each request is
sent whole and streamed, and must satisfy what OpenAI's API reference and the README describe:

- the stream is ``data: {json}`` events ending with ``data: [DONE]``; every chunk has the stream's one id,
  the served model, the chunk's object type and choice indexes in range, and each index gets exactly one
  finish_reason, in its last chunk; a chat choice's first delta has the assistant role; with
  include_usage every chunk has ``"usage": null`` but a last one with no choices that carries the usage;
- the stream reassembled per choice equals the whole response: text, finish_reason, logprobs (tokens,
  offsets, values within float tolerance), and usage's prompt, completion and total tokens;
- the greedy choices of one request are all equal, and equal the gRPC API's greedy output for the same
  prompt without stop strings, cut before the stop string where one occurs (finish_reason "stop",
  the text holds no stop string);
- completion_tokens is the number of logprobs entries and at most max_tokens; finish_reason is "length"
  exactly when max_tokens ended the choice, and "stop" when it ended earlier;
- with echo, each choice starts with the prompt (as sent, or its tokens' text) and its logprobs with one
  entry per prompt token, the first null; with max_tokens 0 that is the whole choice ("length", no
  completion tokens);
- afterwards every KV block is free and nothing is in flight.

Responses are also parsed with the ``openai`` package's pydantic types, which hold OpenAI's field shapes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conftest import Planes
from tests.reliability import all_blocks_free, wait_until

MAX_TOKENS = 16
VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's, which the tiny model shares
TOLERANCE = 1e-3  # on log-probabilities computed in batches of other shapes
PROMPTS = ("Once upon a time", "The capital of France is", "def fib(n):\n", "Zürich, 東京 and São Paulo 🙂", " ")
CHATS = ([{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
         [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3"},
          {"role": "user", "content": [{"type": "text", "text": "Again, "}, {"type": "text", "text": "slower."}]}])
PIECES = [*"abcxyz .,!?\n", "é", "東", "🙂", " the"]
TEXT = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join)
# a special token too: a completion prompt may hold one, chat content may not (only the template places them)
RAW_TEXT = st.lists(st.sampled_from([*PIECES, "<|im_end|>"]), min_size=1, max_size=12).map("".join)
STOP_TEXT = st.text(st.sampled_from([*"aeinrst .,\n", "é"]), min_size=1, max_size=3)
USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
LOGPROBS = (None, 0, 1, 2, 3, 4, 5)  # how many top alternatives per token, or no logprobs
PROPERTY = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Reference:
    """The gRPC API's greedy output for a prompt, without stop strings."""

    text: str
    finish_reason: str  # as OpenAI names it
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float]  # of each sampled token


@pytest.fixture(scope="module")
def planes(tiny_qwen3_dir, tmp_path_factory):
    planes = Planes(tmp_path_factory.mktemp("http-property"), tiny_qwen3_dir, ("--block-size", "16"),
                    http_listen="127.0.0.1:0").start()
    yield planes
    planes.stop()


@pytest.fixture(scope="module")
def http(planes):
    with httpx.Client(base_url=f"http://127.0.0.1:{planes.plane.http_port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def references(planes):
    """Greedy gRPC outputs, cached by prompt, max_tokens and ignore_eos (hypothesis repeats examples)."""
    cache: dict[str, Reference] = {}
    with planes.client() as grpc_client:
        def reference(prompt_field: str, prompt, max_tokens: int, ignore_eos: bool) -> Reference:
            key = json.dumps([prompt_field, prompt, max_tokens, ignore_eos])
            if key not in cache:
                field = "token_ids" if prompt_field == "prompt" and isinstance(prompt, list) else prompt_field
                if field == "messages":  # gRPC takes a message's text parts joined
                    prompt = [{**m, "content": plain_content(m["content"])} for m in prompt]
                stream = grpc_client.generate(**{field: prompt}, max_tokens=max_tokens, temperature=0,
                                              ignore_eos=ignore_eos, logprobs=0, timeout=60)
                chunks = list(stream)
                final = stream.final
                reason = {"stop_token": "stop", "length": "length"}[final.finish_reason]
                cache[key] = Reference("".join(c.text for c in chunks), reason, final.usage.prompt_tokens,
                                       final.usage.completion_tokens, [p.logprob for c in chunks for p in c.logprobs])
            return cache[key]
        yield reference


def plain_content(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


# ---- requests -------------------------------------------------------------------------------------


@st.composite
def requests(draw) -> dict:
    """A greedy request body (without stop strings and stream), and its endpoint as "chat"."""
    chat = draw(st.booleans())
    body = {"temperature": 0, "n": draw(st.integers(1, 4)), "ignore_eos": draw(st.booleans())}
    max_tokens = draw(st.integers(1, MAX_TOKENS))
    if chat:
        body["messages"] = draw(st.sampled_from(CHATS) | TEXT.map(lambda t: [{"role": "user", "content": t}]))
        body["max_completion_tokens" if draw(st.booleans()) else "max_tokens"] = max_tokens
        top = draw(st.sampled_from(LOGPROBS))
        if draw(st.booleans()):
            body["logprobs"] = True
            if top is not None:
                body["top_logprobs"] = top
    else:
        token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)
        prompt = draw(st.sampled_from(PROMPTS) | RAW_TEXT | token_ids)
        body["prompt"] = [prompt] if draw(st.booleans()) else prompt  # a batch of one is one prompt
        if draw(st.booleans()):
            body["echo"] = True
            max_tokens = 0 if draw(st.booleans()) else max_tokens  # the prompt alone
        body["max_tokens"] = max_tokens
        logprobs = draw(st.sampled_from(LOGPROBS))
        if logprobs is not None:
            body["logprobs"] = logprobs
    return {"chat": chat, "body": body}


def stop_strings(draw, text: str):
    """None, or a string or a list of 1-3: substrings of text (so that they occur), or random ones."""
    def occurring():
        start = draw(st.integers(0, len(text) - 1))
        return text[start:start + draw(st.integers(1, 4))]

    kind = draw(st.sampled_from(["none", "occurring", "random", "mixed"] if text else ["none", "random"]))
    if kind == "none":
        return None
    stops = [occurring() if kind == "occurring" or kind == "mixed" and i == 0 else draw(STOP_TEXT)
             for i in range(draw(st.integers(1, 3)))]
    return stops[0] if len(stops) == 1 and draw(st.booleans()) else stops


def top_count(body: dict, chat: bool) -> int | None:
    """How many top alternatives per token the body asks for, or None without logprobs."""
    if chat:
        return body.get("top_logprobs", 0) if body.get("logprobs") else None
    return body.get("logprobs")


# ---- responses ------------------------------------------------------------------------------------


def post_whole(http: httpx.Client, chat: bool, body: dict) -> dict:
    response = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    (ChatCompletion if chat else Completion).model_validate(answer if chat else sdk_shaped(answer))
    return answer


def sdk_shaped(completion: dict) -> dict:
    """A completion as the SDK's type takes it: its logprobs hold no null, which the API sends (as OpenAI's
    did) for an echoed prompt's first token."""
    choices = []
    for choice in completion["choices"]:
        lp = choice["logprobs"]
        if lp is not None:
            lp = {**lp, "token_logprobs": [0.0 if v is None else v for v in lp["token_logprobs"]],
                  "top_logprobs": [{} if t is None else t for t in lp["top_logprobs"]]}
        choices.append({**choice, "logprobs": lp})
    return {**completion, "choices": choices}


def post_stream(http: httpx.Client, chat: bool, body: dict) -> list[dict]:
    """The chunks of a streamed request, its SSE framing checked."""
    with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    chunks = []
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event, event
        chunk = json.loads(event[len("data: "):])
        assert "error" not in chunk, chunk
        if chat:
            ChatCompletionChunk.model_validate(chunk)
        else:  # the SDK's type for these chunks is Completion, whose finish_reason is null until the last one
            Completion.model_validate(sdk_shaped({**chunk, "choices": [
                {**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}))
        chunks.append(chunk)
    return chunks


def text_of(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


def merge_logprobs(chat: bool, parts: list[dict | None]) -> dict:
    """The logprobs of a choice's chunks as one object, as in a whole response."""
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    columns = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {name: [value for part in parts for value in part[name]] for name in columns}


def reassemble(chunks: list[dict], chat: bool, n: int, logprobs: bool) -> list[dict]:
    """The choices of a stream, shaped as a whole response's choices; checks each chunk's choice on the way."""
    texts, reasons, parts = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    stops: list = [None] * n  # each choice's stop_reason, in its last chunk only (as vLLM's)
    begun = [False] * n
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            assert 0 <= i < n, chunk
            assert not reasons[i], f"choice {i} goes on after its finish_reason: {chunk}"
            if chat:
                delta = choice["delta"]
                if not begun[i]:  # a choice begins with its role alone, as OpenAI's and vLLM's
                    assert (delta, choice["logprobs"], choice["finish_reason"]) == (
                        {"role": "assistant", "content": ""}, None, None), f"not the role alone first: {chunk}"
                    begun[i] = True
                    continue
                assert "role" not in delta, f"role in the first delta only: {chunk}"
                texts[i] += delta.get("content") or ""
            else:
                texts[i] += choice["text"]
            assert (choice["logprobs"] is not None) == logprobs, chunk
            parts[i].append(choice["logprobs"])
            if choice["finish_reason"] is not None:
                reasons[i].append(choice["finish_reason"])
                stops[i] = choice["stop_reason"]
            else:
                assert "stop_reason" not in choice, f"stop_reason before the choice's last chunk: {chunk}"
    assert all(len(r) == 1 for r in reasons), f"finish_reasons per choice: {reasons}"
    choices = []
    for i in range(n):
        choice = {"index": i, "finish_reason": reasons[i][0],
                  "logprobs": merge_logprobs(chat, parts[i]) if logprobs else None, "stop_reason": stops[i]}
        choice.update({"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]})
        choices.append(choice)
    return choices


def assert_close(got, want, where: str = "") -> None:
    """Equal JSON values, floats within TOLERANCE."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: {got!r} != {want!r}"
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, str):
        assert math.isclose(got, want, abs_tol=TOLERANCE), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def tokens_of(choice: dict, chat: bool) -> list:
    """A choice's logprobs entries, one per generated token."""
    return choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]


def sampled_logprobs(choice: dict, chat: bool) -> list[float]:
    lp = choice["logprobs"]
    return [e["logprob"] for e in lp["content"]] if chat else lp["token_logprobs"]


def token_bytes(name: str) -> bytes:
    """A token's bytes from its name in log-probabilities: its text, or "bytes:\\xe2\\x80" for part of a character."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", name))
    return name.encode()


def check_logprobs(choice: dict, chat: bool, top: int) -> None:
    """Shapes OpenAI documents; greedy sampled the most likely token."""
    lp = choice["logprobs"]
    if chat:
        for entry in lp["content"]:
            assert entry["logprob"] <= 0 and entry["bytes"] == list(token_bytes(entry["token"])), entry
            assert len(entry["top_logprobs"]) == top, entry
            if top:
                assert entry["logprob"] >= entry["top_logprobs"][0]["logprob"] - TOLERANCE, entry
        return
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][:1] in ([], [0])
    for logprob, alternatives in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and len(alternatives) <= top + 1  # the sampled token may come on top of them
        if top:
            assert logprob >= max(alternatives.values()) - TOLERANCE, alternatives


def check_against_reference(choice: dict, completion_tokens: int, ref: Reference, stops: list[str],
                            max_tokens: int, ignore_eos: bool, chat: bool) -> None:
    """A greedy choice is the gRPC API's output, cut before a stop string that occurs in it."""
    text, reason = text_of(choice), choice["finish_reason"]
    cut = any(s in ref.text for s in stops)
    assert 1 <= completion_tokens <= max_tokens
    if cut:
        assert reason == "stop", (reason, stops, ref.text)
        assert ref.text.startswith(text), (text, ref.text, stops)
        assert any(ref.text[len(text):].startswith(s) for s in stops), (text, ref.text, stops)
        assert not any(s in text for s in stops), (text, stops)
        assert completion_tokens <= ref.completion_tokens
    else:
        assert (text, reason, completion_tokens) == (ref.text, ref.finish_reason, ref.completion_tokens), stops
    # "length" exactly when max_tokens ended the choice; an end-of-sequence token or a stop string is "stop"
    assert reason in ("stop", "length")
    if reason == "length":
        assert completion_tokens == max_tokens and not cut
    if completion_tokens < max_tokens or cut:
        assert reason == "stop"
    if ignore_eos and not cut:
        assert reason == "length"
    if choice["logprobs"] is not None:
        assert len(tokens_of(choice, chat)) == completion_tokens
        for got, want in zip(sampled_logprobs(choice, chat), ref.logprobs):
            assert math.isclose(got, want, abs_tol=TOLERANCE), (sampled_logprobs(choice, chat), ref.logprobs)


def check_whole(whole: dict, chat: bool, body: dict, stops: list[str], top: int | None, ref: Reference) -> None:
    """The whole response: its choices all equal (greedy) and equal to the gRPC API's output."""
    n = body["n"]
    assert whole["object"] == ("chat.completion" if chat else "text_completion")
    assert [c["index"] for c in whole["choices"]] == list(range(n))
    usage = whole["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == ref.prompt_tokens
    assert usage["completion_tokens"] % n == 0, usage  # the prompt counted once, the equal completions n times
    first = whole["choices"][0]
    for choice in whole["choices"]:
        assert_close({**choice, "index": 0}, first, f"choice {choice['index']} vs choice 0")
        assert (choice["logprobs"] is not None) == (top is not None)
        if chat:
            assert choice["message"]["role"] == "assistant"
        if top is not None:
            check_logprobs(choice, chat, top)
    max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
    check_against_reference(first, usage["completion_tokens"] // n, ref, stops, max_tokens, body["ignore_eos"], chat)


def without_echo(whole: dict, shown: str, top: int | None) -> dict:
    """The whole response without the echoed prompt in front of each choice: its text, and with logprobs one
    entry per prompt token (the first null, as nothing scores it), both checked on the way."""
    num_prompt = whole["usage"]["prompt_tokens"]
    choices = []
    for choice in whole["choices"]:
        assert choice["text"].startswith(shown), (choice["text"], shown)
        choice = {**choice, "text": choice["text"][len(shown):]}
        lp = choice["logprobs"]
        if top is not None:
            assert len(lp["tokens"]) >= num_prompt and lp["token_logprobs"][0] is None is lp["top_logprobs"][0], lp
            assert all(v <= 0 and len(alternatives) <= top + 1 for v, alternatives in
                       zip(lp["token_logprobs"][1:num_prompt], lp["top_logprobs"][1:num_prompt])), lp
            choice["logprobs"] = {name: values[num_prompt:] for name, values in lp.items()}
            # the offsets count the characters of the echoed prompt before the completion's
            choice["logprobs"]["text_offset"] = [offset - len(shown) for offset in choice["logprobs"]["text_offset"]]
        choices.append(choice)
    return {**whole, "choices": choices}


def check_stream(chunks: list[dict], whole: dict, chat: bool, n: int, top: int | None, include_usage: bool) -> None:
    """The stream's chunks, and its choices and usage against the whole response's."""
    assert chunks[0]["id"].startswith("chatcmpl-" if chat else "cmpl-")
    for chunk in chunks:
        assert (chunk["id"], chunk["created"]) == (chunks[0]["id"], chunks[0]["created"])
        assert chunk["model"] == whole["model"]
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
    if include_usage:  # "usage": null in every chunk but a last one, with no choices
        *chunks, last = chunks
        assert last["choices"] == [] and all("usage" in c and c["usage"] is None for c in chunks), last
        assert {k: last["usage"][k] for k in USAGE} == {k: whole["usage"][k] for k in USAGE}
    else:
        assert all(c.get("usage") is None and c["choices"] for c in chunks)
    for got, want in zip(reassemble(chunks, chat, n, top is not None), whole["choices"], strict=True):
        assert_close(got, want, f"streamed choice {want['index']}")


# ---- the property ---------------------------------------------------------------------------------


@PROPERTY
@given(request=requests(), data=st.data())
def test_streamed_and_whole_responses_agree(planes, http, references, request, data):
    chat, body = request["chat"], request["body"]
    prompt_field = "messages" if chat else "prompt"
    prompt = body[prompt_field]
    if not chat and isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
    top = top_count(body, chat)
    include_usage = data.draw(st.booleans(), label="include_usage")
    shown = None  # with echo: the prompt as each choice starts with it
    if body.get("echo"):
        shown = prompt if isinstance(prompt, str) else planes.engine.tokenizer.decode(prompt, skip_special_tokens=False)
    if max_tokens == 0:  # echo alone
        whole = post_whole(http, chat, body)
        usage = whole["usage"]
        assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
        for choice in without_echo(whole, shown, top)["choices"]:  # nothing but the prompt
            assert (choice["text"], choice["finish_reason"]) == ("", "length")
            assert top is None or not any(choice["logprobs"].values()), choice
        streamed = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
        check_stream(post_stream(http, chat, streamed), whole, chat, body["n"], top, include_usage)
        wait_until(lambda: all_blocks_free(planes), 10, "every KV block free after the request")
        return
    ref = references(prompt_field, prompt, max_tokens, body["ignore_eos"])
    stop = stop_strings(data.draw, ref.text)
    if stop is not None:
        body["stop"] = stop
    stops = [stop] if isinstance(stop, str) else stop or []

    whole = post_whole(http, chat, body)
    check_whole(whole if shown is None else without_echo(whole, shown, top), chat, body, stops, top, ref)
    streamed = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
    check_stream(post_stream(http, chat, streamed), whole, chat, body["n"], top, include_usage)
    wait_until(lambda: all_blocks_free(planes), 10, "every KV block free after the request")


def test_nothing_left_in_flight(planes):
    """After all the examples: every KV block is free, no request is left, nothing waits."""
    wait_until(lambda: all_blocks_free(planes), 20, "every KV block free")
    assert not planes.engine.requests and planes.engine.num_waiting == 0
