"""--reasoning-parser: a chat completion's <think>...</think> text apart from its answer, whole or
streamed in pieces cut anywhere, and through the HTTP API."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from twinplane.controlplane.api import Limits, RequestOutput
from twinplane.controlplane.chat_text import ChatText
from twinplane.controlplane.openai_api import parse_request
from twinplane.controlplane.openai_stream import ResponseBuilder
from twinplane.controlplane.reasoning import ReasoningSplitter, prompt_state, split_reasoning
from twinplane.controlplane.sequence import FinishReason

WHOLE = [  # parser, text, (reasoning, content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", "Paris.", ("", "Paris.")),  # no thinking (enable_thinking false)
    ("qwen3", " \n<think>a</think>b", ("a", "b")),  # whitespace before the tag is dropped
    ("qwen3", "x<think>a</think>b", ("", "x<think>a</think>b")),  # not an opening: all answer
    ("qwen3", "<think>cut short by max_tokens", ("cut short by max_tokens", "")),
    ("qwen3", "<thin", ("", "<thin")),  # ended inside what might have been the tag
    ("qwen3", "<think>a</think>b</think>c", ("a", "b</think>c")),  # only the first close counts
    ("qwen3", "", ("", "")),
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "<think>a</think>b", ("a", "b")),  # the model opened it again
    ("deepseek_r1", "never closed", ("never closed", "")),
    ("deepseek_r1", "a</thin", ("a</thin", "")),
]


@pytest.mark.parametrize("parser, text, expected", WHOLE)
def test_whole_text_splits(parser, text, expected):
    assert split_reasoning(parser, text) == expected


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("parser, text, expected", WHOLE)
def test_pieces_cut_anywhere_join_to_the_whole_split(parser, text, expected):
    for cut in range(len(text) + 1):  # every cut into two, an empty piece included
        assert _streamed(parser, [text[:cut], text[cut:]]) == expected, cut
    assert _streamed(parser, list(text) + [""]) == expected  # a character a piece, then the end


def test_random_texts_in_random_pieces():
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "</thi", "<th"]
    for _ in range(2000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 4))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for parser in ("qwen3", "deepseek_r1"):
            assert _streamed(parser, pieces) == split_reasoning(parser, text), (parser, pieces)


def _outputs(pieces: list[str]) -> list[RequestOutput]:
    outs = [RequestOutput("r", text=piece) for piece in pieces]
    outs[-1].finish_reason = FinishReason.LENGTH
    return outs


@pytest.mark.parametrize("parser, pieces, tokens", [
    ("qwen3", ["<", "think", ">", "a", "b", "</think>", "\n\n", "Par", "is"], 6),  # the tags' tokens count too
    ("qwen3", ["Paris", "."], 0),
    ("deepseek_r1", ["hm", "m", "</think>", "x"], 3),
    ("deepseek_r1", ["never", " closed"], 2),
])
def test_reasoning_tokens_are_the_tokens_of_the_reasoning_pieces(parser, pieces, tokens):
    text = ChatText(parser, None)
    for i, piece in enumerate(pieces):
        text.feed(piece, final=i == len(pieces) - 1, num_tokens=1)
    assert text.reasoning_tokens == tokens


def test_a_piece_part_reasoning_counts_its_tokens_by_the_share_of_characters():
    text = ChatText("qwen3", None)
    text.feed("<think>ab</think>cd", final=True, num_tokens=10)  # reasoning "<think>ab</think>", content "cd"
    assert text.reasoning_tokens == 9  # 17 of 19 characters


def test_reasoning_tokens_do_not_hang_on_how_the_text_was_cut_into_pieces():
    """The tags' tokens count as reasoning, also when held (a piece that may start "</think>") or when they
    come in one piece with the content after them."""
    tokens = ["<", "think", ">", "Paris", " is", " in", " France", ".", "</", "think", ">", "\n\n", "Paris", "."]
    counts = set()
    for size in range(1, len(tokens) + 1):
        text = ChatText("qwen3", None)
        pieces = [tokens[i:i + size] for i in range(0, len(tokens), size)]
        for i, piece in enumerate(pieces):
            text.feed("".join(piece), final=i == len(pieces) - 1, num_tokens=len(piece))
        counts.add(text.reasoning_tokens)
    assert counts <= {11, 12} and 11 in counts  # 11 exactly, one token about where a piece spans "</think>"


def test_chat_chunks_and_message_carry_reasoning_content_apart():
    request = parse_request({"messages": [{"role": "user", "content": "hi"}]}, Limits(100, 64), "r", chat=True)
    pieces = ["<think>", "hmm</th", "ink>\n\nPar", "is."]
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, reasoning_parser="qwen3")
    chunks = [builder.chunks(0, out) for out in _outputs(pieces)]
    assert [[c["choices"][0]["delta"] for c in outs] for outs in chunks] == [
        [{"role": "assistant", "content": ""}],  # "<think>" alone: held back, no chunk of its own
        [{"reasoning": "hmm", "reasoning_content": "hmm"}],
        [{"content": "\n\nPar"}], [{"content": "is."}]]
    whole = ResponseBuilder(request, "chatcmpl-r", "m", None, reasoning_parser="qwen3")  # not streamed
    for out in _outputs(pieces):
        whole.add(0, out)
    message = whole.response({})["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nParis.", "reasoning": "hmm", "reasoning_content": "hmm"}
    plain = ResponseBuilder(request, "chatcmpl-r", "m", None)  # no parser: the text as it came
    assert plain.chunks(0, _outputs(["<think>a</think>b"])[0])[-1]["choices"][0]["delta"] == {
        "content": "<think>a</think>b"}
    completion = parse_request({"prompt": "hi"}, Limits(100, 64), "r", chat=False)
    text = ResponseBuilder(completion, "cmpl-r", "m", None, reasoning_parser="qwen3")
    assert text.chunks(0, _outputs(["<think>a"])[0])[-1]["choices"][0]["text"] == "<think>a"  # completions: untouched


def test_without_include_reasoning_a_piece_of_reasoning_alone_has_no_chunk():
    """include_reasoning false: the reasoning goes out in no delta and no message, the answer as usual; a piece
    that was reasoning alone has no chunk, unless it ends the choice (or carries logprobs)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "include_reasoning": False}
    request = parse_request(body, Limits(100, 64), "r", chat=True)
    pieces = ["<think>", "hmm</th", "ink>\n\nPar", "is."]
    builder = ResponseBuilder(request, "chatcmpl-r", "m", None, reasoning_parser="qwen3")
    chunks = [builder.chunks(0, out) for out in _outputs(pieces)]
    assert [[c["choices"][0]["delta"] for c in pair] for pair in chunks] == [
        [{"role": "assistant", "content": ""}], [], [{"content": "\n\nPar"}], [{"content": "is."}]]
    whole = ResponseBuilder(request, "chatcmpl-r", "m", None, reasoning_parser="qwen3")
    for out in _outputs(pieces):
        whole.add(0, out)
    assert whole.response({})["choices"][0]["message"] == {"role": "assistant", "content": "\n\nParis."}
    last = _outputs(["<think>cut short"])[0]
    last.finish_reason = FinishReason.LENGTH
    ended = ResponseBuilder(request, "chatcmpl-r", "m", None, reasoning_parser="qwen3").chunks(0, last)[-1]
    assert ended["choices"][0]["delta"] == {"content": ""} and ended["choices"][0]["finish_reason"] == "length"


def test_include_reasoning_false_over_http(tmp_path, smollm2_dir):
    """Whole and streamed, the scripted reply's reasoning stays out and its answer comes as it would with it;
    a completion, whose text is never split, refuses the field."""
    from tests.test_tools import scripted_planes

    question = [{"role": "user", "content": "Think first?"}]
    with scripted_planes(tmp_path, smollm2_dir, [("", "<think>Paris is in France.</think>\n\nParis.")],
                         reasoning_parser="qwen3") as (planes, _):
        url = f"http://127.0.0.1:{planes.plane.http_port}/v1"
        counted = []
        for include in (True, False):
            body = {"messages": question, "include_reasoning": include}
            whole = httpx.post(f"{url}/chat/completions", json=body, timeout=30).json()
            message = whole["choices"][0]["message"]
            assert message["content"] == "\n\nParis."
            counted.append(whole["usage"]["completion_tokens_details"]["reasoning_tokens"])  # drawn either way
            assert message.get("reasoning_content", "gone") == ("Paris is in France." if include else "gone")
            with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}, timeout=30) as reply:
                events = [line for line in reply.iter_lines() if line.startswith("data: {")]
            deltas = [json.loads(event.removeprefix("data: "))["choices"][0]["delta"] for event in events]
            assert "".join(d.get("content", "") for d in deltas) == "\n\nParis."
            assert "".join(d.get("reasoning_content", "") for d in deltas) == ("Paris is in France." if include
                                                                               else "")
        refused = httpx.post(f"{url}/completions", json={"prompt": "hi", "include_reasoning": False}, timeout=30)
    assert counted[0] == counted[1] > 0
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include_reasoning"
    assert "only for /v1/chat/completions" in refused.json()["error"]["message"]


def test_the_http_api_returns_reasoning_content(tiny_qwen3_dir, planes_factory):
    """deepseek_r1 takes text with no </think> as all reasoning: the tiny model's greedy answer comes back
    as reasoning_content (streamed and whole), equal to the gRPC text, and content is empty."""
    planes = planes_factory(tiny_qwen3_dir, "--block-size", "16", http_listen="127.0.0.1:0",
                            reasoning_parser="deepseek_r1")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with planes.client() as grpc_client:
        expected = grpc_client.generate_text(messages=question, max_tokens=12, temperature=0, ignore_eos=True)
    assert expected and "</think>" not in expected
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(model=None, messages=question, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (expected, "")
    assert message.model_extra["reasoning"] == expected  # vLLM's name for it, beside DeepSeek's
    assert whole.usage.completion_tokens_details.reasoning_tokens == 12  # every token was reasoning
    streamed = client.chat.completions.create(model=None, messages=question, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
    deltas = [chunk.choices[0].delta for chunk in chunks[:-1]]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == expected
    assert "".join(d.content or "" for d in deltas) == ""
    reply = httpx.post(f"http://127.0.0.1:{planes.plane.http_port}/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 2})
    assert "reasoning_content" not in reply.text  # completions keep their text


@pytest.mark.parametrize("tail, state", [
    ("<|im_start|>assistant\n<think>\n", "reasoning"),  # a thinking-only model's template opens it
    ("<|im_start|>user\nWhat is <think> for?<|im_end|>\n<|im_start|>assistant\n", None),  # only the end counts
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),  # enable_thinking false
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", None),  # an earlier turn's, closed: the text says
    ("<|im_start|>assistant\n", None),
])
def test_how_the_prompt_ends_says_where_the_text_starts(tail, state):
    assert prompt_state(tail) == state


class TailTokenizer:
    """Stands in for the tokenizer: token i is the i-th character of text."""

    def __init__(self, text: str):
        self.text = text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.text[i] for i in ids)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_opened_or_closed_the_thinking_decides_the_split(parser):
    """Whole and streamed alike: after a prompt that left <think> open the text is reasoning up to </think>
    (with qwen3 too, which otherwise wants <think> first); after one that closed it, all answer (with
    deepseek_r1 too, which otherwise starts in the reasoning)."""
    request = parse_request({"messages": [{"role": "user", "content": "hi"}]}, Limits(100, 64), "r", chat=True)
    for prompt, pieces, expected in [
            ("assistant\n<think>\n", ["I reason", " here.</th", "ink>\n\nThe answer."],
             {"reasoning_content": "I reason here.", "content": "\n\nThe answer."}),
            ("assistant\n<think>\n\n</think>\n\n", ["The answer", " at once."],
             {"reasoning_content": None, "content": "The answer at once."}),
            ("assistant\n<think>\n", ["<th", "ink>\nOpened again.</think>", "Then this."],  # its <think> dropped
             {"reasoning_content": "\nOpened again.", "content": "Then this."})]:
        tokenizer = TailTokenizer(prompt)
        outs = _outputs(pieces)
        outs[0].prompt_ids = list(range(len(prompt)))
        streamed = ResponseBuilder(request, "chatcmpl-r", "m", tokenizer, reasoning_parser=parser)
        deltas = [streamed.chunks(0, out)[-1]["choices"][0]["delta"] for out in outs]
        whole = ResponseBuilder(request, "chatcmpl-r", "m", tokenizer, reasoning_parser=parser)
        for out in outs:
            whole.add(0, out)
        message = whole.response({})["choices"][0]["message"]
        assert {k: message[k] for k in expected} == expected, (prompt, message)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (expected["reasoning_content"] or "")
        assert "".join(d.get("content", "") for d in deltas) == expected["content"]


def test_a_continued_open_thinking_is_reasoning_over_both_apis(tmp_path, smollm2_dir):
    """A final assistant message that opened <think> and is continued: what the model writes up to </think> is
    reasoning, with qwen3 too, over HTTP and over gRPC (parse_output)."""
    from tests.test_tools import scripted_planes

    messages = [{"role": "user", "content": "Opened?"}, {"role": "assistant", "content": "<think>\n"}]
    with scripted_planes(tmp_path, smollm2_dir, [("Opened", "I reason here.</think>\n\nThe answer."), ("", "Plain.")],
                         reasoning_parser="qwen3") as (planes, stand_in):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{planes.plane.http_port}/v1", api_key="x", max_retries=0)
        whole = client.chat.completions.create(model="scripted", messages=messages, extra_body={
            "add_generation_prompt": False, "continue_final_message": True}).choices[0].message
        with planes.client() as grpc_client:
            chunks = list(grpc_client.generate(messages=messages, add_generation_prompt=False,
                                               continue_final_message=True, parse_output=True))
    assert stand_in.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    assert (whole.reasoning_content, whole.content) == ("I reason here.", "\n\nThe answer.")
    assert "".join(c.reasoning_text for c in chunks) == "I reason here."
    assert "".join(c.text for c in chunks) == "\n\nThe answer."
