"""Structured output: requests whose text must match a regular expression.

Every form a client asks for (a JSON Schema, any JSON object, a regex, one of a list of choices, a
forced tool call) becomes one regular expression in the frontend (``openai_api._output_regex``,
``api._output_regex_from_pb``), carried in ``RequestParams.regex``. The engine core compiles it
(``grammar.py``: a byte-level automaton) and keeps each such sequence's place in it
(``TokenMatcher``); every plan that samples the sequence
carries the mask of the tokens that keep its text a prefix of a match, and the data plane samples
among them (the model's end-of-sequence tokens only once the text is a whole match).

On a server with a reasoning parser, a chat request's constraint applies to the answer: the
reasoning before it (``<think>`` ... ``</think>``, as the parser reads it) is free (``after_reasoning``).

A masked sequence planned while its last token is still being sampled decodes it as any sequence
does, but its next mask depends on that token: the plan's masks follow it (``plan_codec.masks_message``,
sent once the token is back), and the data plane samples when they come. It takes no part in plans
of several decode steps.

``allowed_token_ids`` (vLLM's) is the simplest constraint: the same mask at every step
(``FixedTokens``), known before the token in flight is, so it goes in the plan itself. ``bad_words``
(vLLM's) ban tokens (``BannedWords``): a word of one token at every step, so its mask is fixed too,
and the last token of a longer word right after the rest of it, a mask that follows the tokens.
A request may ask for several of these at once (``AllOf``): it samples what all of them allow.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict

import numpy as np

from twinplane.controlplane.errors import InvalidRequest
from twinplane.controlplane.grammar import Grammar, GrammarError, TokenVocab, allowed_tokens, regex_literal
from twinplane.controlplane.json_schema import SchemaError, any_json_regex, schema_regex
from twinplane.controlplane.reasoning import CLOSE, OPEN

MAX_CHOICES = 256  # most strings a choice list may hold
MAX_PATTERN_CHARS = 16_384  # longest regex a client may send (and most characters of a choice list's strings)


def avoiding(tag: str) -> str:
    """A regex of every text in which tag does not occur (tag's first character occurs only there): the
    automaton that looks for tag, written out; it loops back to its start on a character that breaks
    the match, and to after the first character on that character itself."""
    assert tag[0] not in tag[1:], tag
    first, rest = regex_literal(tag[0]), [regex_literal(c) for c in tag[1:]]
    back = f"[^{rest[-1]}{first}]"  # the paths back to the start: a prefix of rest, then a breaking character
    for c in reversed(rest[:-1]):
        back = f"(?:[^{c}{first}]|{c}{back})"
    started = ""  # a proper prefix of rest, short of the tag's last character
    for c in reversed(rest[:-1]):
        started = f"{c}(?:{started})?" if started else c
    again = f"(?:(?:{started})?{first})*"  # the first character again, after a part of the tag or none
    return f"(?:[^{first}]|{first}{again}{back})*(?:{first}{again}(?:{started})?)?"


def after_reasoning(regex: str, parser: str) -> str:
    """The regex of a reasoning model's whole text whose answer matches regex: ``qwen3``, an optional
    ``<think>`` ... ``</think>`` first; ``deepseek_r1``, reasoning up to ``</think>`` (its ``<think>`` is in
    the prompt; one written anyway at the start is taken)."""
    thinking = rf"{avoiding(CLOSE)}{regex_literal(CLOSE)}\s*"
    if parser == "qwen3":
        return rf"(?:\s*{regex_literal(OPEN)}{thinking})?(?:{regex})"
    return f"(?:{regex_literal(OPEN)})?{thinking}(?:{regex})"


@functools.lru_cache(maxsize=64)
def compiled(regex: str) -> Grammar:
    """The automaton of regex (GrammarError when it is not one this server compiles), kept for the next
    requests that send the same one."""
    return Grammar.from_regex(regex)


def compile_shared(reasoning_parser: str | None) -> None:
    """Compiles the grammar many requests share, ``{"type": "json_object"}``'s (for chat too, after the
    reasoning), ahead of them: ~0.1 s that the first such request would otherwise hold the engine core up."""
    regex = any_json_regex()
    compiled(regex)
    if reasoning_parser is not None:
        compiled(after_reasoning(regex, reasoning_parser))


def checked_regex(regex: str, where: str) -> str:
    """regex, once it compiles to a grammar some text matches; else InvalidRequest naming where it came from."""
    problem = _regex_problem(regex)
    if problem is not None:
        raise InvalidRequest(f"{where}: {problem}")
    return regex


VERDICTS_KEPT = 256
_verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # by the pattern's digest, the latest last
_verdicts_lock = threading.Lock()


def _regex_problem(regex: str) -> str | None:
    """What keeps regex from constraining an output, or None; kept for the next requests that send it.
    Only the verdict is kept, by the pattern's digest: the engine core, which runs the grammar, compiles
    its own (an automaton can take MiBs, and a pattern made from a schema or tools as many characters)."""
    key = hashlib.blake2b(regex.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    with _verdicts_lock:
        if key in _verdicts:
            _verdicts.move_to_end(key)
            return _verdicts[key]
    try:
        grammar = Grammar.from_regex(regex)
        problem = "no text matches it" if grammar.initial_state == Grammar.DEAD else None
    except GrammarError as exc:
        problem = str(exc)
    with _verdicts_lock:
        _verdicts[key] = problem
        while len(_verdicts) > VERDICTS_KEPT:
            _verdicts.popitem(last=False)
    return problem


def client_regex(regex, where: str) -> str:
    """A regex as a client sent it, checked: a non-empty string of at most MAX_PATTERN_CHARS that compiles."""
    if not isinstance(regex, str) or not regex:
        raise InvalidRequest(f"{where} must be a non-empty string")
    if len(regex) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"{where} is {len(regex)} characters long; at most {MAX_PATTERN_CHARS} are allowed")
    return checked_regex(regex, where)


def json_schema_regex(schema, where: str) -> str:
    """The regex of the JSON texts valid under schema (a parsed JSON Schema)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{where} must be a JSON Schema (an object), got {type(schema).__name__}")
    try:
        return checked_regex(schema_regex(schema), where)
    except SchemaError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None


def choice_regex(choices, where: str) -> str:
    """The regex of exactly one of the strings in choices."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"{where} must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"{where} holds {len(choices)} strings; at most {MAX_CHOICES} are allowed")
    if sum(map(len, choices)) > MAX_PATTERN_CHARS:
        raise InvalidRequest(f"{where}: its strings hold {sum(map(len, choices))} characters; at most "
                             f"{MAX_PATTERN_CHARS} are allowed")
    return checked_regex("|".join(f"(?:{regex_literal(c)})" for c in choices), where)


def schema_text(schema: str, where: str):
    """A JSON Schema sent as JSON text (gRPC), parsed."""
    try:
        return json.loads(schema)
    except (ValueError, RecursionError):
        raise InvalidRequest(f"{where} must be the JSON text of a JSON Schema") from None


def structured_regex_from_pb(spec) -> str:
    """The regex of a gRPC StructuredOutput."""
    kind = spec.WhichOneof("kind")
    where = f"structured_output.{kind}"
    if kind == "json_schema":
        return json_schema_regex(schema_text(spec.json_schema, where), where)
    if kind == "json_object" and spec.json_object:
        return any_json_regex()
    if kind == "regex" and spec.regex:
        return client_regex(spec.regex, where)
    if kind == "choice":
        return choice_regex(list(spec.choice.choices), where)
    raise InvalidRequest("structured_output must set one of json_schema (a JSON Schema's text), json_object "
                         "(true), regex (non-empty) or choice")


class Vocabulary:
    """The bytes of every token, for the masks of one model (the width of its logits)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, tags: tuple[str, ...] = ()):
        """tags: special tokens a grammar may still write (a tool-call parser's tags). Tokens past the
        model's vocabulary (a tokenizer may hold more than its embedding) are never allowed."""
        token_bytes = list(tokenizer.token_bytes())[:vocab_size]
        for tag in tags:
            token_id = tokenizer.token_id(tag)
            if token_id is not None and token_id < vocab_size:
                token_bytes[token_id] = tag.encode()
        self.token_bytes = token_bytes
        self.vocab = TokenVocab(token_bytes, eos_token_ids, vocab_size)


class FixedTokens:
    """A sequence that may sample only the given token ids (allowed_token_ids): one mask for every step."""

    name = "allowed_token_ids"
    fixed = True  # its mask does not depend on the tokens sampled
    failure = None
    whole = False

    def __init__(self, token_ids, vocab_size: int):
        self._mask = token_bits(token_ids, vocab_size).tobytes()

    def accept(self, token_id: int) -> None:
        """Nothing to follow."""

    def mask(self) -> bytes:
        return self._mask


def bad_words_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's tokens at the start of a text, and after a space when the space
    joins its first token and leaves as many tokens (not when the space is a token of its own)."""
    out = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


class BannedWords:
    """A sequence with bad_words (their token ids): a word of one token is never sampled, and a longer word's
    last token not right after the rest of it among the sequence's output."""

    name = "bad_words"
    failure = None
    whole = False

    def __init__(self, words: tuple[tuple[int, ...], ...], vocab_size: int, token_ids=()):
        words = [w for w in words if max(w) < vocab_size]  # one the model cannot write needs no ban
        self._allowed = np.zeros(-(-vocab_size // 8) * 8, dtype=bool)
        self._allowed[:vocab_size] = True
        self._allowed[[w[0] for w in words if len(w) == 1]] = False
        self._base = np.packbits(self._allowed, bitorder="little").tobytes()
        self._longer = [w for w in words if len(w) > 1]
        self.fixed = not self._longer  # one-token words only: one mask for every step
        self._tail: list[int] = []  # the last tokens, as many as a longer word's but one
        self._keep = max((len(w) - 1 for w in self._longer), default=0)
        for token_id in token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        if self._keep:
            self._tail = [*self._tail, token_id][-self._keep:]

    def mask(self) -> bytes:
        ends = [w[-1] for w in self._longer if tuple(self._tail[len(self._tail) - len(w) + 1:]) == w[:-1]]
        if not ends:
            return self._base
        allowed = self._allowed.copy()
        allowed[ends] = False
        return np.packbits(allowed, bitorder="little").tobytes()


class TokenMatcher:
    """One sequence's place in its grammar: what it may sample next.

    A grammar whose automaton grows past its bound while it is used (``grammar.MAX_DFA_STATES``) sets
    ``failure`` (the message the request ends with) instead of raising, and allows only the stop tokens
    from then on: the engine core ends the request with that message once it sees the token.
    """

    name = "structured output"
    fixed = False  # its mask depends on the tokens sampled

    def __init__(self, grammar: Grammar, vocabulary: Vocabulary, token_ids=()):
        self.grammar, self.vocabulary = grammar, vocabulary
        self.state = grammar.initial_state
        self.failure: str | None = None
        for token_id in token_ids:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        """The sequence sampled token_id (a stop token adds no text)."""
        token_bytes = self.vocabulary.token_bytes
        data = token_bytes[token_id] if 0 <= token_id < len(token_bytes) else None
        if data and self.failure is None:
            try:
                self.state = self.grammar.advance(self.state, data)
            except GrammarError as exc:
                self.failure, self.state = f"structured output: {exc}", Grammar.DEAD

    @property
    def whole(self) -> bool:
        """The text is a match that no byte can extend: only a stop token may come."""
        return self.grammar.is_final(self.state)

    def mask(self) -> bytes:
        """The tokens it may sample next, one bit per token id (dataplane.proto's TokenMask)."""
        try:
            return allowed_tokens(self.grammar, self.state, self.vocabulary.vocab)
        except GrammarError as exc:
            self.failure, self.state = f"structured output: {exc}", Grammar.DEAD
            return allowed_tokens(self.grammar, Grammar.DEAD, self.vocabulary.vocab)  # the stop tokens


def token_bits(token_ids, vocab_size: int) -> np.ndarray:
    """A mask's bytes (dataplane.proto's TokenMask: one bit per token id, the lowest first) with the bits of
    token_ids set."""
    bits = np.zeros(-(-vocab_size // 8) * 8, dtype=bool)
    bits[list(token_ids)] = True
    return np.packbits(bits, bitorder="little")


class AllOf:
    """A sequence under several constraints at once (structured output, ``allowed_token_ids``, ``bad_words``):
    it may sample the tokens every one of them allows.

    Where they leave no token, a grammar whose text is a match may still end it (its stop tokens stay
    allowed); else the request fails with ``failure`` once its next token, a stop token, is back, as a
    grammar that cannot go on does.
    """

    def __init__(self, parts: list, stop_mask: np.ndarray):
        self.parts = parts
        self.fixed = all(part.fixed for part in parts)
        self._grammar = next((part for part in parts if isinstance(part, TokenMatcher)), None)
        self._stop = stop_mask  # the end-of-sequence tokens' bits
        self._failure: str | None = None
        self._fixed_mask = self._combined() if self.fixed else None

    @property
    def failure(self) -> str | None:
        return self._failure or next((part.failure for part in self.parts if part.failure), None)

    @property
    def whole(self) -> bool:
        return self._grammar is not None and self._grammar.whole

    def accept(self, token_id: int) -> None:
        for part in self.parts:
            part.accept(token_id)

    def mask(self) -> bytes:
        return self._fixed_mask if self._fixed_mask is not None else self._combined()

    def _combined(self) -> bytes:
        masks = [np.frombuffer(part.mask(), np.uint8) for part in self.parts]
        allowed = np.bitwise_and.reduce(masks)
        if allowed.any():
            return allowed.tobytes()
        ends = self._stop & np.frombuffer(self._grammar.mask(), np.uint8) if self._grammar is not None else allowed
        if ends.any():
            return ends.tobytes()
        names = " and ".join(part.name for part in self.parts)
        self._failure = f"{names} leave no token to write next"
        return self._stop.tobytes()
