r"""Constrained decoding: a regular expression as a byte-level automaton, and the tokens each state allows.

The whole output has to match the pattern. Its characters are Unicode code points, but tokens are
byte strings that may end inside a multi-byte character, so the pattern compiles into an automaton
over the UTF-8 bytes of the output: a Thompson NFA whose edges are byte ranges, walked as a DFA
built lazily (a subset of NFA states becomes a DFA state the first time some byte string reaches
it). For a state, ``allowed_tokens`` is the packed bitmask of the tokens whose bytes keep the output
a prefix of a match, computed with numpy a level at a time down a trie of the tokens' bytes, and cached
per state.

The regex subset (anything else is a GrammarError that says where and what):

- literal characters; escaped punctuation (``\. \\ \* \( \[ \{ \| \$ \/ \"`` ...) as literals;
  ``\n \t \r \f \v``, ``\0`` (with up to two more octal digits), ``\xHH``, ``\uHHHH``, ``\UHHHHHHHH``;
- ``\d \w \s`` with their ASCII meanings, and ``\D \W \S``, their complements (all non-ASCII code points
  included); ``.``, any code point but ``\n``;
- classes ``[...]`` and ``[^...]`` of characters, escapes, ranges (``a-z``, ``\u4e00-\u9fff``) and
  ``\d \w \s \D \W \S``; a ``]`` first or a ``-`` first or last is literal, ``\b`` is a backspace;
- groups ``(...)``, ``(?:...)``, ``(?P<name>...)`` and ``(?<name>...)``, all plain groups; alternation ``|``;
- quantifiers ``* + ? {n} {n,} {,m} {n,m}`` (counts up to 1000), each optionally lazy (``*?``: the same
  language); a ``{`` that does not open a quantifier is literal, as in Python's ``re``;
- ``^`` at the very start and ``$`` at the very end, which change nothing.

Code point sets exclude the surrogates (U+D800..U+DFFF, which UTF-8 cannot encode), so ``[^"]``
accepts exactly the valid UTF-8 encodings of every other code point.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import numpy as np

MAX_COUNT = 1000  # the largest count a {n,m} quantifier may hold
MASK_CACHE_BYTES = 256 << 20  # masks kept, every grammar's together; the least recently used go first
MAX_DFA_STATES = 20_000  # automaton states one grammar may build while it is used (GrammarError past them)
MAX_NFA_EDGES = 200_000  # byte-range edges one pattern's NFA may hold (its memory: ~70 bytes each)
# characters a pattern may hold: one this long holds more edges than MAX_NFA_EDGES (each edge takes at
# least one character, and syntax around it), and is refused before its parse takes seconds
MAX_PATTERN_LEN = 8 * MAX_NFA_EDGES
# NFA states one automaton state may hold: the work of each step's mask grows with them (GrammarError past them)
MAX_DFA_SET = 1_000
DENSE_SHARE = 8  # a mask walk steps a trie level's every node when its live parents are > 1/DENSE_SHARE of them
SUPPORTED = ("supported: literals, escaped punctuation, \\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH, . \\d \\D "
             "\\w \\W \\s \\S, [...] and [^...] classes, groups (...) (?:...) (?P<name>...), alternation |, "
             f"quantifiers * + ? {{n}} {{n,}} {{n,m}} (counts up to {MAX_COUNT}, lazy or not), ^ at the start and $ at "
             "the end")

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


_META = set("\\.^$*+?{}[]()|-")  # the characters a regex of this dialect (and Python's) gives a meaning


def regex_literal(text: str) -> str:
    """A regex that matches text exactly, inside a class or out (control characters as \\xHH escapes)."""
    return "".join("\\" + c if c in _META else f"\\x{ord(c):02x}" if ord(c) < 0x20 else c for c in text)


class GrammarError(ValueError):
    """A pattern that is not a regex of the supported subset, or too large a one."""


def _fail(what: str, position: int) -> NoReturn:
    raise GrammarError(f"regex: {what} (at position {position}); {SUPPORTED}")


# --- code point sets: sorted, disjoint (lo, hi) ranges, surrogates excluded -----------------------

def _normalized(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = []
    for lo, hi in merged:  # cut the surrogates out
        out += [(lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)]
    return tuple((lo, hi) for lo, hi in out if lo <= hi)


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    gaps, start = [], 0
    for lo, hi in ranges:
        gaps.append((start, lo - 1))
        start = hi + 1
    gaps.append((start, MAX_CODE_POINT))
    return _normalized(g for g in gaps if g[0] <= g[1])


DIGIT = ((0x30, 0x39),)
WORD = _normalized([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = ((0x09, 0x0D), (0x20, 0x20))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": _complement(DIGIT), "W": _complement(WORD), "S": _complement(SPACE)}
DOT = _complement(((0x0A, 0x0A),))
CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
UNSUPPORTED_ESCAPES = {"b": "word boundary \\b", "B": "non-boundary \\B", "A": "anchor \\A", "Z": "anchor \\Z",
                       "z": "anchor \\z", "k": "back-reference \\k<name>", "p": "Unicode property \\p{...}",
                       "P": "Unicode property \\P{...}", "G": "anchor \\G"}


def _utf8(cp: int, length: int) -> list[int]:
    """The UTF-8 bytes of cp in a given encoded length (the surrogates never come here)."""
    if length == 1:
        return [cp]
    lead = (0, 0, 0xC0, 0xE0, 0xF0)[length]
    return [lead | cp >> 6 * (length - 1)] + [0x80 | (cp >> 6 * k) & 0x3F for k in range(length - 2, -1, -1)]


def _utf8_sequences(lo: int, hi: int, length: int = 0) -> Iterable[list[tuple[int, int]]]:
    """Byte-range sequences whose products are exactly the UTF-8 encodings of lo..hi: split first by
    encoded length, then wherever a continuation byte would otherwise not span its full range."""
    if not length:
        for length, top in enumerate((0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT), 1):
            bottom = (0, 0x80, 0x800, 0x10000)[length - 1]
            if max(lo, bottom) <= min(hi, top):
                yield from _utf8_sequences(max(lo, bottom), min(hi, top), length)
        return
    for tail in range(1, length):  # the last `tail` continuation bytes
        low_bits = (1 << 6 * tail) - 1
        if lo & ~low_bits != hi & ~low_bits:
            if lo & low_bits:
                yield from _utf8_sequences(lo, lo | low_bits, length)
                yield from _utf8_sequences((lo | low_bits) + 1, hi, length)
                return
            if hi & low_bits != low_bits:
                yield from _utf8_sequences(lo, (hi & ~low_bits) - 1, length)
                yield from _utf8_sequences(hi & ~low_bits, hi, length)
                return
    yield list(zip(_utf8(lo, length), _utf8(hi, length)))


@functools.lru_cache(maxsize=4096)
def _utf8_paths(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The byte-range sequences of a code point set, kept: a pattern repeats its classes (a JSON Schema's
    strings, each a copy of the same class), and so do the patterns a server sees."""
    return tuple(tuple(sequence) for lo, hi in ranges for sequence in _utf8_sequences(lo, hi))


# --- parsing: the pattern as a tree of code point sets, sequences, alternations and repetitions ---

@dataclass(frozen=True)
class _Chars:
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Concat:
    parts: tuple


@dataclass(frozen=True)
class _Alt:
    options: tuple


@dataclass(frozen=True)
class _Repeat:
    item: object
    low: int
    high: int | None  # None: unbounded


_COUNTS = re.compile(r"\{(\d*)(,?)(\d*)\}")
_GROUP_NAME = re.compile(r"\?P?<([^\W\d]\w*)>")
_GROUP_EXTENSIONS = (("?<=", "lookbehind (?<=...)"), ("?<!", "negative lookbehind (?<!...)"),
                     ("?=", "lookahead (?=...)"), ("?!", "negative lookahead (?!...)"),
                     ("?P=", "back-reference (?P=name)"), ("?P<", "a bad group name in (?P<name>...)"),
                     ("?<", "a bad group name in (?<name>...)"), ("?#", "comment (?#...)"),
                     ("?>", "atomic group (?>...)"), ("?(", "conditional (?(...)...)"))


class _Parser:
    def __init__(self, pattern: str):
        self.pattern, self.at = pattern, 0

    def parse(self):
        tree = self._alternation()
        if self.at < len(self.pattern):  # only a ')' stops the top level early
            _fail("unbalanced parenthesis: ')' without '('", self.at)
        return tree

    def _peek(self, ahead: int = 0) -> str:
        return self.pattern[self.at + ahead] if self.at + ahead < len(self.pattern) else ""

    def _alternation(self):
        options = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def _sequence(self):
        parts = []
        while self._peek() not in ("", "|", ")"):
            if self._quantifier(consume=False):
                _fail(f"nothing to repeat before {self._peek()!r}", self.at)
            atom = self._atom()
            if atom is None:  # an anchor
                continue
            counts = self._quantifier()
            if counts:
                if self._peek() == "?":  # lazy: the same language
                    self.at += 1
                if self._quantifier(consume=False):
                    _fail("a quantifier after a quantifier (possessive *+, or a repeat repeated)", self.at)
                atom = _Repeat(atom, *counts)
            parts.append(atom)
        return parts[0] if len(parts) == 1 else _Concat(tuple(parts))

    def _quantifier(self, consume: bool = True) -> tuple[int, int | None] | None:
        """(low, high) of the quantifier at the cursor, if one is there."""
        char, start = self._peek(), self.at
        if char in ("*", "+", "?"):
            counts, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char], start + 1
        else:
            found = _COUNTS.match(self.pattern, start) if char == "{" else None
            if not found or not (found[1] or found[2]):  # "{" opening no quantifier is a literal
                return None
            low = int(found[1] or 0)
            high = low if not found[2] else int(found[3]) if found[3] else None
            if consume and max(low, high or 0) > MAX_COUNT:
                _fail(f"quantifier count over {MAX_COUNT} in {found[0]}", start)
            if consume and high is not None and low > high:
                _fail(f"quantifier {found[0]} with its minimum over its maximum", start)
            counts, end = (low, high), found.end()
        if consume:
            self.at = end
        return counts

    def _atom(self):
        char, start = self._peek(), self.at
        self.at += 1
        if char == "(":
            return self._group(start)
        if char == "[":
            return _Chars(self._class(start))
        if char == ".":
            return _Chars(DOT)
        if char == "^":
            return None if start == 0 else _fail("'^' anywhere but at the very start", start)
        if char == "$":
            return None if self.at == len(self.pattern) else _fail("'$' anywhere but at the very end", start)
        if char == "\\":
            item = self._escape(in_class=False)
            return _Chars(item if isinstance(item, tuple) else _normalized([(item, item)]))
        return _Chars(_normalized([(ord(char), ord(char))]))

    def _group(self, start: int):
        if self._peek() == "?":
            named = _GROUP_NAME.match(self.pattern, self.at)
            if self.pattern.startswith("?:", self.at):
                self.at += 2
            elif named:
                self.at = named.end()
            else:
                what = next((name for prefix, name in _GROUP_EXTENSIONS if self.pattern.startswith(prefix, self.at)),
                            "inline flags or an unknown group (?...)")
                _fail(f"{what} is not supported", start)
        tree = self._alternation()
        if self._peek() != ")":
            _fail("unbalanced parenthesis: '(' never closed", start)
        self.at += 1
        return tree

    def _class(self, start: int) -> tuple[tuple[int, int], ...]:
        negated = self._peek() == "^"
        self.at += negated
        ranges, first = [], True
        while True:
            char, at = self._peek(), self.at
            if not char:
                _fail("unterminated character class '['", start)
            if char == "]" and not first:
                self.at += 1
                break
            first = False
            low = self._class_item()
            if self._peek() == "-" and self._peek(1) not in ("", "]"):
                self.at += 1
                high = self._class_item()
                if isinstance(low, tuple) or isinstance(high, tuple):
                    _fail("a class escape (\\d \\w \\s ...) as the end of a range", at)
                if low > high:
                    _fail(f"range {self.pattern[at:self.at]} with its start after its end", at)
                ranges.append((low, high))
            elif isinstance(low, tuple):
                ranges += low
            else:
                ranges.append((low, low))
        ranges = _normalized(ranges)
        return _complement(ranges) if negated else ranges

    def _class_item(self) -> int | tuple:
        char = self._peek()
        self.at += 1
        return self._escape(in_class=True) if char == "\\" else ord(char)

    def _escape(self, in_class: bool) -> int | tuple:
        """After a backslash: a code point, or a code point set for \\d \\w \\s and their negations."""
        start, char = self.at - 1, self._peek()
        self.at += 1
        if not char:
            _fail("a trailing backslash", start)
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES:
            return CHAR_ESCAPES[char]
        if char == "b" and in_class:
            return 0x08
        if char == "0":
            octal = re.compile("[0-7]{0,2}").match(self.pattern, self.at)
            self.at = octal.end()
            return int("0" + octal[0], 8)
        if char in "xuU":
            digits = {"x": 2, "u": 4, "U": 8}[char]
            text = self.pattern[self.at:self.at + digits]
            if not re.fullmatch(f"[0-9A-Fa-f]{{{digits}}}", text) or int(text, 16) > MAX_CODE_POINT:
                _fail(f"\\{char} needs {digits} hex digits of a code point up to 10FFFF", start)
            self.at += digits
            return int(text, 16)
        if char in UNSUPPORTED_ESCAPES:
            _fail(f"{UNSUPPORTED_ESCAPES[char]} is not supported", start)
        if char in "123456789":
            _fail(f"back-reference \\{char} is not supported", start)
        if char.isascii() and char.isalpha():
            _fail(f"unknown escape \\{char}", start)
        return ord(char)


# --- the automaton ---------------------------------------------------------------------------------

class _NFA:
    """Thompson's construction over byte ranges: state -> [(lo, hi, target)] and state -> [target] (epsilon).
    Fragments are built from a given state; a loop always returns to a state made for that loop."""

    def __init__(self, max_states: int):
        self.max_states = max_states
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.num_edges = 0

    def state(self) -> int:
        if len(self.edges) >= self.max_states:
            raise GrammarError(f"regex: the pattern is too large: its automaton would exceed {self.max_states} "
                               "states (large counted repetitions of large groups); write a smaller pattern")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node, start: int) -> int:
        """Adds node's fragment leaving from start; returns the state it ends in."""
        if isinstance(node, _Chars):
            return self._chars(node.ranges, start)
        if isinstance(node, _Concat):
            for part in node.parts:
                start = self.build(part, start)
            return start
        if isinstance(node, _Alt):
            end = self.state()
            for option in node.options:
                self.eps[self.build(option, start)].append(end)
            return end
        for _ in range(node.low):  # a _Repeat: its required copies, then the optional ones or a loop
            start = self.build(node.item, start)
        if node.high is None:
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(node.item, loop)].append(loop)
            return loop
        if node.high == node.low:
            return start
        end = self.state()
        for _ in range(node.high - node.low):
            self.eps[start].append(end)
            start = self.build(node.item, start)
        self.eps[start].append(end)
        return end

    def _chars(self, ranges, start: int) -> int:
        """The UTF-8 encodings of a code point set, as byte-range paths sharing their common prefixes."""
        end, prefixes = self.state(), {}
        paths = _utf8_paths(ranges)
        self.num_edges += sum(map(len, paths))  # at most: shared prefixes make fewer
        if self.num_edges > MAX_NFA_EDGES:
            raise GrammarError(f"regex: the pattern is too large: its automaton would exceed {MAX_NFA_EDGES} "
                               "transitions (large counted repetitions of wide character classes); write a smaller "
                               "pattern")
        for sequence in paths:
            state = start
            for byte_range in sequence[:-1]:
                if (state, byte_range) not in prefixes:
                    prefixes[state, byte_range] = self.state()
                    self.edges[state].append((*byte_range, prefixes[state, byte_range]))
                state = prefixes[state, byte_range]
            self.edges[state].append((*sequence[-1], end))
        return end


class Grammar:
    """A compiled regular expression over the UTF-8 bytes of the output; the whole output must match."""

    DEAD = 0  # the empty set of NFA states: no continuation matches

    @classmethod
    def from_regex(cls, pattern: str, max_states: int = 100_000) -> Grammar:
        """GrammarError when the pattern is not of the supported subset or its NFA exceeds max_states."""
        if len(pattern) > MAX_PATTERN_LEN:
            raise GrammarError(f"the pattern is too large: {len(pattern)} characters, where at most {MAX_PATTERN_LEN} "
                               "compile (a smaller schema, fewer tools or a simpler regex)")
        try:
            tree = _Parser(pattern).parse()
            nfa = _NFA(max_states)
            start = nfa.state()
            accept = nfa.build(tree, start)
        except RecursionError:
            raise GrammarError(f"regex: the pattern nests too deeply; {SUPPORTED}") from None
        return cls(pattern, nfa, start, accept)

    def __init__(self, pattern: str, nfa: _NFA, start: int, accept: int):
        """From the NFA of pattern (Grammar.from_regex builds it); the DFA starts with DEAD and the initial state."""
        self.pattern = pattern
        self.serial = next(_SERIALS)  # this grammar among all (the mask cache's name for it)
        self._edges, self._eps = self._live_only(nfa, accept)
        self._accept = accept
        ranges = sorted({(lo, hi) for edges in self._edges for lo, hi, _ in edges})
        byte = np.arange(256)[:, None]
        members = np.concatenate([np.zeros((256, 1), bool)] +
                                 [(byte >= lo) & (byte <= hi) for lo, hi in ranges], axis=1)
        _, byte_class = np.unique(members, axis=0, return_inverse=True)
        self._byte_class = byte_class.reshape(256).astype(np.uint8)  # bytes no edge tells apart share a class
        self._class_list = self._byte_class.tolist()
        self._class_byte = [self._class_list.index(c) for c in range(int(self._byte_class.max()) + 1)]
        self._num_classes = len(self._class_byte)
        self._trans = np.full((64, self._num_classes), -1, np.int32)  # -1: not computed yet
        self._sets: list[frozenset] = []
        self._ids: dict[frozenset, int] = {}
        self._accepting: list[bool] = []
        self._ends: list[bool] = []  # no byte can follow
        self._lock = threading.RLock()
        self._intern(frozenset())
        self._trans[self.DEAD] = self.DEAD
        self.initial_state = self._intern(self._closure({start}))

    @staticmethod
    def _live_only(nfa: _NFA, accept: int):
        """The NFA's edges into states from which the accepting state can be reached, so that every
        non-empty DFA state still has a match ahead and DEAD is the only dead end."""
        into: list[list[int]] = [[] for _ in nfa.edges]
        for state, (edges, eps) in enumerate(zip(nfa.edges, nfa.eps)):
            for target in [edge[2] for edge in edges] + eps:
                into[target].append(state)
        live, stack = {accept}, [accept]
        while stack:
            for source in into[stack.pop()]:
                if source not in live:
                    live.add(source)
                    stack.append(source)
        edges = [[edge for edge in edges if edge[2] in live] for edges in nfa.edges]
        return edges, [[target for target in eps if target in live] for eps in nfa.eps]

    def _closure(self, states: set[int]) -> frozenset:
        """The states reached through epsilon edges, keeping only those that matter to a DFA state:
        ones with byte edges, and the accepting one."""
        seen, stack = set(states), list(states)
        while stack:
            for target in self._eps[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(s for s in seen if self._edges[s] or s == self._accept)

    def _intern(self, states: frozenset) -> int:
        found = self._ids.get(states)
        if found is not None:
            return found
        if len(states) > MAX_DFA_SET:
            raise GrammarError(f"regex: matching it keeps more than {MAX_DFA_SET} positions of the pattern open at "
                               "once (many long alternatives in flight, e.g. after a loop that any text matches); "
                               "write a pattern that decides sooner")
        if len(self._sets) >= MAX_DFA_STATES:
            raise GrammarError(f"regex: matching it took more than {MAX_DFA_STATES} automaton states (too many "
                               "alternatives in flight at once, e.g. a long repetition after a loop); write a "
                               "pattern that decides sooner")
        state = self._ids[states] = len(self._sets)
        self._sets.append(states)
        self._accepting.append(self._accept in states)
        self._ends.append(not any(self._edges[s] for s in states))
        if state == len(self._trans):
            grown = np.full((2 * state, self._num_classes), -1, np.int32)
            grown[:state] = self._trans
            self._trans = grown
        return state

    def _fill(self, pairs: Iterable[int]) -> None:
        """Computes the transitions of (state * num_classes + class) pairs not computed yet."""
        with self._lock:
            for pair in pairs:
                state, byte_class = divmod(pair, self._num_classes)
                if self._trans[state, byte_class] < 0:
                    byte = self._class_byte[byte_class]
                    targets = {target for s in self._sets[state] for lo, hi, target in self._edges[s]
                               if lo <= byte <= hi}
                    target = self._intern(self._closure(targets))
                    self._trans[state, byte_class] = target

    def _step(self, states: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """The next state of each (state, byte class) pair, computing those not known yet."""
        pairs = states.astype(np.int64) * self._num_classes + classes
        following = np.take(self._trans, pairs)
        missing = following < 0
        if missing.any():
            self._fill(np.unique(pairs[missing]).tolist())
            following[missing] = np.take(self._trans, pairs[missing])
        return following

    def advance(self, state: int, data: bytes) -> int:
        """The state after data; DEAD once data leaves the language."""
        for byte in data:
            if state == self.DEAD:
                break
            byte_class = self._class_list[byte]
            following = self._trans[state, byte_class]
            if following < 0:
                self._fill([state * self._num_classes + byte_class])
                following = self._trans[state, byte_class]
            state = following
        return int(state)

    @property
    def crowded(self) -> bool:
        """Its automaton holds most of the states it may build (MAX_DFA_STATES): new requests are better given a
        fresh one, so that those matching in it keep the states left (``EngineCore._prepared``)."""
        return len(self._sets) >= MAX_DFA_STATES * 3 // 4

    def is_accepting(self, state: int) -> bool:
        """The output so far is a full match."""
        return self._accepting[state]

    def is_final(self, state: int) -> bool:
        """A full match that no byte can extend: only end-of-sequence may come."""
        return self._accepting[state] and self._ends[state]

    def __repr__(self) -> str:
        return f"Grammar.from_regex({self.pattern!r})"


class _Level(NamedTuple):
    """The trie's nodes at one depth: the distinct byte prefixes of that length, in byte order."""

    byte: np.ndarray  # each node's last byte
    parent: np.ndarray  # each node's parent, one level up
    children: np.ndarray  # node i's children are the next level's nodes children[i]:children[i + 1]
    token_ids: np.ndarray  # the tokens whose bytes end at this depth, by node
    token_node: np.ndarray  # the node each of them ends at
    ends: np.ndarray  # node i's tokens are token_ids[ends[i]:ends[i + 1]]


class TokenVocab:
    """Each token id's bytes (None: never allowed by a grammar, e.g. special/control tokens), for masks,
    as a trie: the tokens that share a prefix step through it once."""

    def __init__(self, token_bytes: list[bytes | None], stop_token_ids: Iterable[int], vocab_size: int):
        """vocab_size: the width of the mask, the model's logits (ids past token_bytes are never allowed)."""
        stops = set(stop_token_ids)
        if len(token_bytes) > vocab_size or any(not 0 <= t < vocab_size for t in stops):
            raise ValueError(f"TokenVocab: {len(token_bytes)} tokens and stop ids {sorted(stops)} must fit in "
                             f"{vocab_size}")
        self.vocab_size = vocab_size
        self.stop_ids = np.array(sorted(stops), np.intp)
        ids = sorted((i for i, data in enumerate(token_bytes) if data and i not in stops), key=token_bytes.__getitem__)
        lengths = np.array([len(token_bytes[i]) for i in ids], np.intp)
        width = int(lengths.max()) if ids else 0
        rows = np.frombuffer(b"".join(token_bytes[i].ljust(width, b"\0") for i in ids), np.uint8)
        rows = rows.reshape(len(ids), width)
        ids = np.array(ids, np.intp)
        self.levels: list[_Level] = []
        differs = np.zeros(len(ids), bool)  # a token's bytes so far differ from those of the token before it
        node = np.zeros(len(ids), np.intp)  # each token's node one level up
        for depth in range(width):
            longer = np.flatnonzero(lengths > depth)  # the tokens this deep, in byte order
            before = longer - 1
            column = rows[longer, depth]
            differs[longer] |= (lengths[before] <= depth) | (rows[before, depth] != column)
            starts = differs[longer]  # the first token of each node
            starts[0] = True
            node_of = np.cumsum(starts) - 1
            count = int(node_of[-1]) + 1
            parent = node[longer[starts]]
            if self.levels:
                above = self.levels[-1]
                self.levels[-1] = above._replace(children=np.searchsorted(parent, np.arange(len(above.byte) + 1)))
            ending = lengths[longer] == depth + 1
            self.levels.append(_Level(column[starts], parent, np.zeros(count + 1, np.intp), ids[longer[ending]],
                                      node_of[ending], np.searchsorted(node_of[ending], np.arange(count + 1))))
            node[longer] = node_of


def _spans(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The indexes starts[0]:stops[0], then starts[1]:stops[1], ..., as one array."""
    counts = stops - starts
    return np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)


def _token_walk(grammar: Grammar, state: int, vocab: TokenVocab) -> np.ndarray:
    """Per token id, whether its bytes lead from state to a live state: the trie's nodes step one level at a
    time (numpy), a node that dies taking its subtree with it. A level where many nodes live steps all of
    its nodes (those under a dead one stay DEAD); one where few do, only the children of those."""
    allowed = np.zeros(vocab.vocab_size, bool)
    if state == Grammar.DEAD or not vocab.levels:
        return allowed
    levels = vocab.levels
    nodes, parents = None, np.full(len(levels[0].byte), state, np.int32)  # nodes None: every node of the level
    for depth, level in enumerate(levels):
        states = grammar._step(parents, grammar._byte_class[level.byte if nodes is None else level.byte[nodes]])
        live = states != Grammar.DEAD
        if nodes is None:
            allowed[level.token_ids[live[level.token_node]]] = True
            num_live = int(np.count_nonzero(live))
        else:
            nodes, states = nodes[live], states[live]
            allowed[level.token_ids[_spans(level.ends[nodes], level.ends[nodes + 1])]] = True
            num_live = len(nodes)
        if not num_live or depth + 1 == len(levels):
            break
        below = levels[depth + 1]
        if num_live * DENSE_SHARE >= len(below.byte):
            if nodes is not None:  # to every node's state, DEAD for the dead
                every = np.zeros(len(level.byte), np.int32)
                every[nodes] = states
                states = every
            nodes, parents = None, states[below.parent]
        else:
            if nodes is None:
                nodes = np.flatnonzero(live)
                states = states[nodes]
            first, last = level.children[nodes], level.children[nodes + 1]
            nodes, parents = _spans(first, last), np.repeat(states, last - first)
    return allowed


class _MaskCache:
    """The masks computed so far, keyed by (grammar serial, vocabulary, state), within MASK_CACHE_BYTES in
    all: a server sees many schemas, and a mask of a 151,936-token vocabulary is 19 KB. It holds no
    grammar (an automaton can take MiBs): a grammar's masks go once nothing else holds it."""

    def __init__(self):
        self.masks: OrderedDict[tuple[int, TokenVocab, int], bytes] = OrderedDict()
        self.keys_of: dict[int, set] = {}  # each grammar's keys, by its serial, from its first mask until it goes
        self.gone: list[int] = []  # serials of grammars collected since (their weakref callbacks append)
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, grammar: Grammar, vocab: TokenVocab, state: int) -> bytes | None:
        key = (grammar.serial, vocab, state)
        with self.lock:
            self._drop_gone()
            mask = self.masks.get(key)
            if mask is not None:
                self.masks.move_to_end(key)
            return mask

    def put(self, grammar: Grammar, vocab: TokenVocab, state: int, mask: bytes) -> None:
        key = (grammar.serial, vocab, state)
        with self.lock:
            self._drop_gone()
            if key in self.masks:
                return
            if grammar.serial not in self.keys_of:
                self.keys_of[grammar.serial] = set()
                weakref.finalize(grammar, self.gone.append, grammar.serial)  # no lock: it may run anywhere
            self.keys_of[grammar.serial].add(key)
            self.masks[key] = mask
            self.bytes += len(mask)
            while self.bytes > MASK_CACHE_BYTES and len(self.masks) > 1:
                old, dropped = self.masks.popitem(last=False)
                self.bytes -= len(dropped)
                self.keys_of[old[0]].discard(old)

    def _drop_gone(self) -> None:
        while self.gone:
            for key in self.keys_of.pop(self.gone.pop(), ()):
                self.bytes -= len(self.masks.pop(key))


_MASKS = _MaskCache()
_SERIALS = itertools.count()


def allowed_tokens(grammar: Grammar, state: int, vocab: TokenVocab) -> bytes:
    """The tokens that may come next in state, one bit per token id (token t: bit t & 7 of byte t >> 3):
    those whose bytes keep the output a prefix of a match, and the stop tokens once it is a full match
    (or when nothing else could come, so that generation can end). Cached (``_MaskCache``)."""
    mask = _MASKS.get(grammar, vocab, state)
    if mask is None:
        with grammar._lock:
            allowed = _token_walk(grammar, state, vocab)
        allowed[vocab.stop_ids] = grammar.is_accepting(state) or not allowed.any()
        mask = np.packbits(allowed, bitorder="little").tobytes()
        _MASKS.put(grammar, vocab, state, mask)
    return mask
