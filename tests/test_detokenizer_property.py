"""Property-based test of the streaming text path (detokenizer, stop strings, min_tokens) on the real
SmolLM2 tokenizer, against a plain reference built from ``Tokenizer.decode`` and ``str.find``.

SmolLM2 is a byte-level BPE: a character of several UTF-8 bytes may be split over tokens, and a token
may hold half a character. Token sequences are drawn from its vocabulary, biased toward such pieces,
whitespace and special tokens, or are encoded random text (emoji, CJK, combining marks...) that is then
cut and perturbed. Each sequence is fed to a ``RequestState`` token by token, as the frontend does
(``engine.py``), and the stream must match the reference:

- the streamed text is the decoded output, cut just before the earliest stop string that occurs in the
  text not sent yet once min_tokens is past (of two starting at the same place, the one listed first);
- a text that ends in U+FFFD (maybe half a character) waits for the next token; at the last token
  everything is sent;
- after each token the stream holds back only that and the longest suffix that could begin a stop
  string, so it never sends half a character or any part of a stop string; every message appends to
  what was sent (the text sent so far is always a prefix of the final text);
- the request ends at the right token with the right finish reason: a stop token (whose own text is
  part of the output only with include_stop_str_in_output), max_tokens, or a stop string (which
  outranks both at its token).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinplane.controlplane.metrics import EngineMetrics
from twinplane.controlplane.request_state import RequestState, Unsent
from twinplane.controlplane.sequence import FinishReason, RequestParams
from twinplane.controlplane.tokenizer import Tokenizer

EOS_ID = 2  # <|im_end|>: a stop token when the request does not ignore it
REPLACEMENT = "\ufffd"  # what decode gives for an incomplete or invalid UTF-8 sequence
PIECES = [*"abcXYZ019 .,!?-_'\"<|>", " ", " ", "  ", "\n", "\n\n", "\t", "é", "ñ", "ü", "ß", "e\u0301", "λ", "Ж",
          "東", "京", "日本語", "中文", "한국어", "ー", "🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "𝄞", "\ufffd",
          "<|im_end|>", "<|im_start|>", " the", " stop", "STOP", "\r\n"]
PROPERTY = settings(max_examples=1200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


class Vocab:
    """The tokenizer and its token ids grouped by the kind of text each one decodes to alone."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        texts = tokenizer.token_texts(list(range(tokenizer.vocab_size)))
        self.partial = [i for i, t in enumerate(texts) if REPLACEMENT in t]  # byte tokens, pieces of emoji and CJK
        self.non_ascii = [i for i, t in enumerate(texts) if not t.isascii() and REPLACEMENT not in t]
        self.spaces = [i for i, t in enumerate(texts) if t.isspace()]  # spaces, newlines, tabs
        self.special = sorted(tokenizer.special_ids)

    def __repr__(self) -> str:  # short, in hypothesis' report of a failing example
        return f"Vocab({self.tokenizer.folder.name})"


@pytest.fixture(scope="module")
def vocab(smollm2_dir) -> Vocab:
    return Vocab(Tokenizer(smollm2_dir))


# ---- drawing requests --------------------------------------------------------------------------


def texts(min_size: int = 0) -> st.SearchStrategy[str]:
    """Random text, mostly of pieces that tokenize awkwardly (emoji, CJK, combining marks, spaces)."""
    return st.lists(st.sampled_from(PIECES) | st.characters(codec="utf-8"), min_size=min_size, max_size=16).map("".join)


def tokens_of(vocab: Vocab) -> st.SearchStrategy[int]:
    """One token id, mostly of the kinds that make streaming text hard."""
    return st.one_of(st.sampled_from(vocab.partial), st.sampled_from(vocab.non_ascii), st.sampled_from(vocab.spaces),
                     st.sampled_from(vocab.special) | st.just(EOS_ID), st.integers(0, vocab.tokenizer.vocab_size - 1))


@st.composite
def outputs(draw, vocab: Vocab) -> list[int]:
    """Sampled tokens: random ids, or encoded random text cut and perturbed (ids inserted, dropped)."""
    if draw(st.booleans()):
        return draw(st.lists(tokens_of(vocab), min_size=1, max_size=32))
    ids = vocab.tokenizer.encode(draw(texts()), add_special_tokens=False)
    start = draw(st.integers(0, len(ids)))
    ids = ids[start:draw(st.integers(start, len(ids)))]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(ids)))
        if draw(st.booleans()) or at == len(ids):
            ids.insert(at, draw(tokens_of(vocab)))
        else:
            del ids[at]
    return ids or [draw(tokens_of(vocab))]


@st.composite
def stop_strings(draw, text: str) -> tuple[str, ...]:
    """One to three stop strings: mostly pieces of text (so that they occur), sometimes random ones."""
    stop = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.integers(0, 3)):
            start = draw(st.integers(0, len(text) - 1))
            stop.append(text[start:draw(st.integers(start + 1, min(start + 6, len(text))))])
        else:
            stop.append(draw(texts(min_size=1)))
    return tuple(stop)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    tokens: list[int]  # what the model samples; max_tokens is their number
    params: RequestParams
    eos: bool  # whether EOS_ID is a stop token (else it is text, as with ignore_eos)


@st.composite
def requests(draw, vocab: Vocab, with_stop: bool) -> Request:
    tokenizer = vocab.tokenizer
    prompt = tokenizer.encode(draw(texts(min_size=1)))  # whole text: it ends on a whole character
    tokens = draw(outputs(vocab))
    skip = draw(st.booleans())
    stop = draw(stop_strings(tokenizer.decode(tokens, skip_special_tokens=skip))) if with_stop else ()
    min_tokens = draw(st.integers(0, len(tokens))) if draw(st.booleans()) else 0
    keep = with_stop and draw(st.booleans())  # include_stop_str_in_output
    params = RequestParams(max_tokens=len(tokens), min_tokens=min_tokens, stop=stop, skip_special_tokens=skip,
                           include_stop_str_in_output=keep)
    return Request(prompt, tokens, params, eos=draw(st.booleans()))


# ---- the stream and its reference --------------------------------------------------------------


@dataclass
class Outcome:
    sent: list[str]  # the text sent so far, after each token
    text: str
    reason: FinishReason
    matched_stop: str
    num_tokens: int  # tokens the request took


def token_rule(request: Request, k: int) -> FinishReason | None:
    """Why the engine core ends the request at its k-th output token (1-based), if it does."""
    params = request.params
    if request.eos and request.tokens[k - 1] == EOS_ID and k > params.min_tokens:
        return FinishReason.STOP_TOKEN
    return FinishReason.LENGTH if k == params.max_tokens else None


def stream(tokenizer: Tokenizer, request: Request) -> Outcome:
    """Feeds the tokens to a RequestState one at a time, as the frontend does, and reads its stream."""
    state = RequestState(1, "r", request.prompt, request.params, tokenizer, 1, EngineMetrics(), 0.0, Unsent())
    sent, text = [], ""
    for k, token in enumerate(request.tokens, 1):
        state.record_token(token, len(request.prompt) + k - 1, None, 0)
        reason = state.add_text(token, token_rule(request, k))
        state.emit(reason)
        messages = [state.outputs.popleft() for _ in range(len(state.outputs))]
        assert [m.token_ids for m in messages] == [[token]]  # one message per token (stream_interval 1)
        text += messages[0].text
        sent.append(text)
        if reason is not None:
            assert messages[0].completion_tokens == k
            return Outcome(sent, text, reason, messages[0].matched_stop, k)
        assert messages[0].finish_reason is None
    raise AssertionError("the request did not end at max_tokens")


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that begins a stop string (and is shorter than it)."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def earliest_stop(text: str, start: int, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the earliest stop string starts in text[start:] (ties: the one listed first), and which."""
    found = [(i, order) for order, s in enumerate(stop) if (i := text.find(s, start)) >= 0]
    if not found:
        return None
    i, order = min(found)
    return i, stop[order]


def reference(tokenizer: Tokenizer, request: Request) -> Outcome:
    """The stream the request should give, from decoding its first k tokens at once after each token k."""
    params, tokens = request.params, request.tokens
    known, unsent_from, sent = "", 0, []  # text known so far; where stop strings are looked for past min_tokens
    for k in range(1, len(tokens) + 1):
        reason = token_rule(request, k)
        # a stop token's text only with include_stop_str_in_output (as vLLM's)
        dropped = reason is FinishReason.STOP_TOKEN and not params.include_stop_str_in_output
        text = tokenizer.decode(tokens[:k - 1] if dropped else tokens[:k],
                                skip_special_tokens=params.skip_special_tokens)
        if reason is not None or not text.endswith(REPLACEMENT):  # else it may end in half a character
            known = text
        if k == params.min_tokens:
            unsent_from = len(known) - held_back(known, params.stop)
        match = earliest_stop(known, unsent_from, params.stop) if k > params.min_tokens else None
        if match is not None:
            end = match[0] + (len(match[1]) if params.include_stop_str_in_output else 0)
            return Outcome(sent + [known[:end]], known[:end], FinishReason.STOP_STRING, match[1], k)
        if reason is not None:
            return Outcome(sent + [known], known, reason, "", k)
        sent.append(known[:len(known) - held_back(known, params.stop)])
    raise AssertionError("unreachable: the last token reaches max_tokens")


def check(tokenizer: Tokenizer, request: Request) -> Outcome:
    """Streams the request, checks the stream against the reference and returns it."""
    got, expected = stream(tokenizer, request), reference(tokenizer, request)
    assert got.text == expected.text
    for so_far in got.sent:  # append-only, whole characters, nothing past the stop string
        assert expected.text.startswith(so_far)
    assert got.sent == expected.sent  # sent as soon as known not to be half a character or part of a stop string
    assert (got.reason, got.matched_stop, got.num_tokens) == (expected.reason, expected.matched_stop,
                                                               expected.num_tokens)
    return got


# ---- the properties ----------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_streamed_text_is_the_decoded_output(vocab, data):
    request = data.draw(requests(vocab, with_stop=False))
    text = check(vocab.tokenizer, request).text
    if not request.eos:  # nothing ends it early: the whole output, decoded at once
        assert text == vocab.tokenizer.decode(request.tokens, skip_special_tokens=request.params.skip_special_tokens)


@PROPERTY
@given(data=st.data())
def test_stop_strings_cut_the_text_and_end_the_request(vocab, data):
    check(vocab.tokenizer, data.draw(requests(vocab, with_stop=True)))
