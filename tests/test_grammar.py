"""The structured-output automaton (controlplane/grammar.py) and token bytes (Tokenizer.token_bytes).

The automaton is checked against Python's ``re.fullmatch`` (ASCII meanings of \\d \\w \\s) on hand-picked,
random and generated strings fed byte by byte; its UTF-8 handling exhaustively over one- and two-byte
strings and around every encoded-length boundary; its masks against a brute-force walk of the real
SmolLM2 vocabulary, and by decoding through them.
"""

from __future__ import annotations

import functools
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from twinplane.controlplane import grammar as grammar_module
from twinplane.controlplane.grammar import Grammar, GrammarError, TokenVocab, allowed_tokens
from twinplane.controlplane.tokenizer import Tokenizer

JSON_STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
# pattern -> strings to try beside random ones (matching and not)
CASES = {
    "abc": ["abc", "ab", "abcd", ""],
    "": ["", "a"],
    "a|b|cd": ["a", "b", "cd", "c", "ab"],
    "(ab)?c": ["c", "abc", "ac", "ababc"],
    "(?:ab|cd)*e": ["e", "abe", "abcdabe", "abc", "ae"],
    "x{3}": ["xx", "xxx", "xxxx"],
    "x{2,4}": ["x", "xx", "xxxx", "xxxxx"],
    "a{,2}b{2,}": ["bb", "abb", "aabbbb", "aaabb", "ab"],
    "(xy){1,}z": ["z", "xyz", "xyxyz", "xyx"],
    "(|a)b": ["b", "ab", "aab"],
    "a*?b+?c??": ["b", "abbc", "aacc", "c"],
    "^hello$": ["hello", "hello\n", "^hello$"],
    "[a-c]+\\d*": ["a", "cab42", "d", "1", "ab1c"],
    "[^a-c]+": ["xyz", "é漢😀", "xa", ""],
    '[^"]*': ["", "plain", "é漢😀\n", 'a"b'],
    "[-a]+[a-]": ["--", "a-a", "b"],
    "[\\]\\[^]+": ["[]", "^", "a"],
    "[\\d\\s]+": ["1 2\t3\n", "1a"],
    "[^\\W\\d]+": ["abc_", "abc1", "é"],
    "\\w+@\\w+\\.(com|org)": ["me@example.com", "me@example.net", "é@x.com"],
    "\\s*\\S+\\s*": [" x ", "é", "  ", "\t\u00e9\u3000"],
    "\\D\\W": ["a!", "é漢", "1!", "aa"],
    "caf[eé] (au lait)?": ["café ", "cafe au lait", "cafè "],
    "[\\u4e00-\\u9fff]{1,3}": ["漢", "漢字語", "漢字語文", "か"],
    "[^\\u4e00-\\u9fff]+": ["かな", "abc", "漢"],
    ".{2,3}": ["ab", "é漢😀", "a\nb", "a"],
    "😀+|[👍-👎]": ["😀😀", "👍", "👏", "😁"],
    "(?P<y>\\d{4})-(?P<m>\\d\\d)": ["2024-05", "24-05"],
    "-?(0|[1-9]\\d*)(\\.\\d+)?([eE][+-]?\\d+)?": ["0", "-12.5e+3", "012", "1.", "1e5"],
    "\\x41\\u00e9\\t\\n\\0\\012": ["Aé\t\n\x00\n", "Ae\t\n\x00\n"],
    '\\{"k": (true|false)\\}': ['{"k": true}', '{"k": null}'],
    "a{}b{,}c{x}": ["a{}c{x}", "a{}bbbc{x}", "ac"],
    JSON_STRING: ['""', '"a\\"b"', '"\\u00e9\\n"', '"a\nb"', '"\\x"', '"漢😀"'],
}
PATTERNS = list(CASES)
EXTRA_CHARS = "ab019 _-.,\"\\\n\té漢😀{}"


def matches(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


@functools.cache
def grammar(pattern: str) -> Grammar:
    return Grammar.from_regex(pattern)


def byte_by_byte(g: Grammar, data: bytes) -> int:
    """The state after data, advanced one byte at a time."""
    state = g.initial_state
    for byte in data:
        state = g.advance(state, bytes([byte]))
    return state


def check_against_re(pattern: str, text: str) -> None:
    g = grammar(pattern)
    state = byte_by_byte(g, text.encode())
    assert state == g.advance(g.initial_state, text.encode())
    assert g.is_accepting(state) == matches(pattern, text), (pattern, text)
    if matches(pattern, text):  # no prefix of a match is a dead end
        assert all(g.advance(g.initial_state, text[:k].encode()) != Grammar.DEAD for k in range(len(text)))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_as_re_fullmatch(pattern):
    rng = random.Random(1234)
    alphabet = sorted(set(pattern + EXTRA_CHARS))
    randoms = ["".join(rng.choices(alphabet, k=rng.randint(0, 10))) for _ in range(150)]
    for text in CASES[pattern] + randoms:
        check_against_re(pattern, text)


@settings(max_examples=400, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_generated_strings_match_as_re_fullmatch(data):
    pattern = data.draw(st.sampled_from(PATTERNS))
    text = data.draw(st.one_of(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True),
                               st.text(alphabet=sorted(set(pattern + EXTRA_CHARS)), max_size=12)))
    assume(not any("\ud800" <= c <= "\udfff" for c in text))  # no UTF-8 for surrogates
    check_against_re(pattern, text)


def test_final_states():
    g = Grammar.from_regex("(yes|no)")
    assert g.is_final(g.advance(g.initial_state, b"yes"))
    assert not g.is_accepting(g.advance(g.initial_state, b"ye"))
    g = Grammar.from_regex("a+")
    one = g.advance(g.initial_state, b"a")
    assert g.is_accepting(one) and not g.is_final(one)
    g = Grammar.from_regex("a{0,2}")
    assert g.is_final(g.advance(g.initial_state, b"aa")) and not g.is_final(g.initial_state)
    dead = g.advance(g.initial_state, b"aaa")
    assert dead == Grammar.DEAD and not g.is_accepting(dead) and not g.is_final(dead)
    assert g.advance(dead, b"a") == Grammar.DEAD


def test_dead_ends_are_dead_at_once():
    """A branch that can never complete (an empty class) is DEAD as soon as it is taken."""
    g = Grammar.from_regex("a(b[^\\s\\S])?")
    assert g.advance(g.initial_state, b"ab") == Grammar.DEAD
    assert g.is_final(g.advance(g.initial_state, b"a"))
    assert Grammar.from_regex("[^\\s\\S]").initial_state == Grammar.DEAD


# --- UTF-8 -------------------------------------------------------------------------------------------

def utf8_verdict(data: bytes) -> tuple[bool, bool]:
    """(a prefix of valid UTF-8, valid UTF-8), by Python's strict decoder: a prefix is one that some
    continuation bytes complete (only the first two bytes of a character constrain each other)."""
    def valid(candidate: bytes) -> bool:
        try:
            candidate.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    if valid(data):
        return True, True
    return any(valid(data + bytes([fill]) * k) for fill in (0x80, 0xBF) for k in (1, 2, 3)), False


@pytest.mark.parametrize("pattern, excluded", [('[^"]*', b'"'), (".*", b"\n")])
def test_every_one_and_two_byte_string(pattern, excluded):
    g = Grammar.from_regex(pattern)
    for first in range(256):
        for second in [None, *range(256)]:
            data = bytes([first] if second is None else [first, second])
            state = g.advance(g.initial_state, data)
            prefix, complete = utf8_verdict(data)
            if excluded in data:
                prefix = complete = False
            assert (state != Grammar.DEAD, g.is_accepting(state)) == (prefix, complete), data


BOUNDARIES = [0, 0x7F, 0x80, 0x7FF, 0x800, 0xFFF, 0x1000, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x3FFFF, 0x40000,
              0xFFFFF, 0x100000, 0x10FFFF]


@pytest.mark.parametrize("pattern, excluded", [('[^"]', '"'), (".", "\n")])
def test_code_points_across_length_boundaries(pattern, excluded):
    g = Grammar.from_regex(pattern)
    rng = random.Random(7)
    around = {cp + d for cp in BOUNDARIES for d in range(-40, 41) if 0 <= cp + d <= 0x10FFFF}
    for cp in sorted(around | {rng.randint(0, 0x10FFFF) for _ in range(3000)}):
        data = chr(cp).encode("utf-8", "surrogatepass")
        state = g.advance(g.initial_state, data)
        surrogate = 0xD800 <= cp <= 0xDFFF
        assert g.is_accepting(state) == (not surrogate and chr(cp) != excluded), hex(cp)
        assert (state == Grammar.DEAD) == (surrogate or chr(cp) == excluded), hex(cp)
        assert g.is_final(state) or state == Grammar.DEAD


@pytest.mark.parametrize("data", [b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xed\xa0\x80",
                                  b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80",
                                  b"\xf5\x80\x80\x80", b"\xff", b"\xfe", b"\x80", b"\xbf", b"a\x80", b"\xc3\xa9\xa9",
                                  b"\xe6\xbc", b"\xf0\x9f\x98"])
def test_invalid_utf8_is_refused(data):
    g = Grammar.from_regex(".*")
    state = g.advance(g.initial_state, data)
    assert state == Grammar.DEAD or not g.is_accepting(state)  # dead, or an unfinished character
    assert not g.is_accepting(g.advance(state, b"a"))


def test_three_and_four_byte_strings():
    """Every lead byte from E0, any second byte, third and fourth bytes at their range edges."""
    g = Grammar.from_regex("[^a]*")
    edges = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF]
    for lead in range(0xE0, 0x100):
        for second in range(256):
            for third in edges:
                for data in [bytes([lead, second, third]), *(bytes([lead, second, third, x]) for x in (0x80, 0xC0))]:
                    state = g.advance(g.initial_state, data)
                    assert (state != Grammar.DEAD, g.is_accepting(state)) == utf8_verdict(data), data


# --- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, named", [
    ("(?=a)b", "lookahead"), ("a(?!b)", "negative lookahead"), ("(?<=a)b", "lookbehind"),
    ("(?<!a)b", "negative lookbehind"), ("(a)\\1", "back-reference"), ("(?P<x>a)(?P=x)", "back-reference"),
    ("\\bword", "word boundary"), ("\\Bx", "\\B"), ("(?i)abc", "inline flags"), ("(?i:a)", "inline flags"),
    ("(?#note)a", "comment"), ("(?>a)", "atomic group"), ("(ab", "unbalanced parenthesis"),
    ("ab)", "unbalanced parenthesis"), ("a{3,2}", "minimum over its maximum"), ("a{1001}", "over 1000"),
    ("a{2,5000}", "over 1000"), ("[abc", "unterminated character class"), ("*a", "nothing to repeat"),
    ("a|+", "nothing to repeat"), ("a**", "quantifier after a quantifier"), ("a*+", "possessive"),
    ("a^b", "'^'"), ("a$b", "'$'"), ("\\p{L}", "Unicode property"), ("a\\", "trailing backslash"),
    ("[z-a]", "start after its end"), ("[a-\\d]", "range"), ("\\q", "unknown escape"), ("\\Aa", "anchor"),
    ("\\xZZ", "hex digits"), ("(?P<1x>a)", "group name"),
])
def test_unsupported_syntax_is_refused(pattern, named):
    with pytest.raises(GrammarError) as info:
        Grammar.from_regex(pattern)
    message = str(info.value)
    assert named in message and "(at position " in message and "supported:" in message, message


def test_too_large_patterns_are_refused():
    Grammar.from_regex("a{1000}")  # the largest count is fine
    with pytest.raises(GrammarError, match="too large"):
        Grammar.from_regex("(.{1000}){1000}")
    with pytest.raises(GrammarError, match="500 states"):
        Grammar.from_regex("[a-z]{1000}", max_states=500)
    with pytest.raises(GrammarError, match="nests too deeply"):
        Grammar.from_regex("(" * 3000 + "a" + ")" * 3000)
    # wide classes counted many times: few states, but millions of edges (hundreds of MB) without the cap
    wide = "[" + "".join(f"\\x{b:02x}" for b in range(1, 128, 2)) + "]{1000}"
    with pytest.raises(GrammarError, match="exceed 200000 transitions"):
        Grammar.from_regex(f"(?:{wide}|{wide}a|{wide}b|{wide}c)")


def test_a_match_that_keeps_too_many_positions_open_fails_while_it_runs(monkeypatch):
    """Each step's mask costs work in proportion to the pattern positions its automaton state holds: past
    MAX_DFA_SET the match fails (the request gets the reason), rather than each step slowing the server."""
    from twinplane.controlplane import grammar

    monkeypatch.setattr(grammar, "MAX_DFA_SET", 5)
    g = Grammar.from_regex("[\\s\\S]*a{10}")  # every 'a' may begin the ten: one more open position each
    state = g.advance(g.initial_state, b"aaa")
    with pytest.raises(GrammarError, match="more than 5 positions of the pattern open"):
        g.advance(state, b"aaaaa")


# --- masks on the real vocabulary -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    eos = tok.token_id("<|im_end|>")
    token_bytes = tok.token_bytes()
    return tok, token_bytes, eos, TokenVocab(token_bytes, [eos], vocab_size=tok.vocab_size + 61)


def mask_bits(mask: bytes, vocab_size: int) -> np.ndarray:
    assert len(mask) == (vocab_size + 7) // 8
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
    assert not bits[vocab_size:].any()
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), count=vocab_size, bitorder="little")
    assert len(bits) == vocab_size
    return bits.astype(bool)


def brute_force(g: Grammar, state: int, token_bytes, eos: int, vocab_size: int) -> np.ndarray:
    allowed = np.zeros(vocab_size, bool)
    for token, data in enumerate(token_bytes):
        allowed[token] = bool(data) and token != eos and g.advance(state, data) != Grammar.DEAD
    allowed[eos] = g.is_accepting(state) or not allowed.any()
    return allowed


JSON_OBJECT = (r'\{\s*"name"\s*:\s*' + JSON_STRING + r'\s*,\s*"age"\s*:\s*-?(0|[1-9]\d*)\s*,\s*"ok"\s*:\s*'
               r'(true|false)\s*\}')
MASK_CASES = [
    (JSON_OBJECT, ["", "{", '{"name": "', '{"name": "Jo', '{"name": "Jo", "age": 4', '{"name": "Jo", "age": 42,'
                   ' "ok": true}']),
    ("(yes|no|maybe)", ["", "ma"]),
    ("[\\u4e00-\\u9fff]{1,4}", ["", "漢"]),
    ("-?\\d+(\\.\\d+)?", ["", "-", "3"]),
    (".{0,6}", ["", "é"]),
]


@pytest.mark.parametrize("pattern, prefixes", MASK_CASES)
def test_masks_equal_brute_force(smollm2, pattern, prefixes):
    _, token_bytes, eos, vocab = smollm2
    g = Grammar.from_regex(pattern)
    states = [g.advance(g.initial_state, p.encode()) for p in prefixes]
    states.append(g.advance(g.initial_state, b"\xe6\xbc"))  # inside a character: dead for most, not the CJK class
    for state in states:
        bits = mask_bits(allowed_tokens(g, state, vocab), vocab.vocab_size)
        assert (bits == brute_force(g, state, token_bytes, eos, vocab.vocab_size)).all(), (pattern, state)
        assert bits[eos] == (g.is_accepting(state) or not np.delete(bits, eos).any())
        assert not bits[len(token_bytes):].any()  # ids past the tokenizer's vocabulary
        assert not any(bits[i] for i, data in enumerate(token_bytes) if data is None and i != eos)


@pytest.mark.parametrize("seed", range(4))
def test_masks_equal_brute_force_on_a_vocabulary_of_shared_prefixes(seed):
    """Tokens that are prefixes of each other, repeat each other's bytes, hold byte 0 or are missing: the
    trie walk still allows exactly the tokens whose bytes keep a match alive."""
    rng = random.Random(seed)
    alphabet = [b"a", b"b", b"\0", b"\xc3", b"\xa9", b"\"", b"{"]
    token_bytes = [b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    token_bytes += token_bytes[:20] + [None, b"", b"a", b"ab", b"aba"]
    eos = len(token_bytes)
    token_bytes.append(None)
    vocab = TokenVocab(token_bytes, [eos], vocab_size=len(token_bytes) + 5)
    for pattern in ['(a|b)*', 'a\\x00?b{0,3}', '[ab\\x00]*"', '\\{"?(é|a)+', '(ab|ba)*a?']:
        g = Grammar.from_regex(pattern)
        for _ in range(6):
            state = g.advance(g.initial_state, b"".join(rng.choice(alphabet[:3]) for _ in range(rng.randint(0, 3))))
            bits = mask_bits(allowed_tokens(g, state, vocab), vocab.vocab_size)
            assert (bits == brute_force(g, state, token_bytes, eos, vocab.vocab_size)).all(), (pattern, state)


def test_dead_states_allow_only_the_stop_tokens(smollm2):
    *_, eos, vocab = smollm2
    g = Grammar.from_regex("abc")
    for state in [Grammar.DEAD, g.advance(g.initial_state, b"abc")]:
        bits = mask_bits(allowed_tokens(g, state, vocab), vocab.vocab_size)
        assert bits[eos] and bits.sum() == 1


def test_masks_are_cached_and_bounded(smollm2, monkeypatch):
    *_, vocab = smollm2
    g = Grammar.from_regex("[a-z]{1,3}")
    first = allowed_tokens(g, g.initial_state, vocab)
    assert allowed_tokens(g, g.initial_state, vocab) is first
    monkeypatch.setattr(grammar_module, "MASK_CACHE_BYTES", 2 * len(first))  # room for two masks, of any grammar
    states = [g.advance(g.initial_state, b"a" * k) for k in range(4)]
    masks = [allowed_tokens(g, s, vocab) for s in states]
    cache = grammar_module._MASKS
    assert [key[2] for key in cache.masks] == states[2:] and cache.bytes == 2 * len(first)
    assert [allowed_tokens(g, s, vocab) for s in states] == masks and masks[0] == first


def test_the_mask_cache_keeps_no_grammar_alive(smollm2):
    """A grammar's masks go when it does: the cache held every grammar it had masks of (automata of up to
    MiBs each, counted as their masks' bytes alone), so a server given a new schema a request grew ~2 MB a
    request."""
    import gc
    import weakref

    *_, vocab = smollm2
    cache = grammar_module._MASKS
    grammars = [Grammar.from_regex(f"q{i}[a-z]{{1,3}}") for i in range(4)]
    for g in grammars:
        allowed_tokens(g, g.initial_state, vocab)
    serials, alive = {g.serial for g in grammars}, [weakref.ref(g) for g in grammars]
    assert serials <= {key[0] for key in cache.masks}
    del grammars, g
    gc.collect()
    assert not [ref for ref in alive if ref() is not None]
    kept = Grammar.from_regex("[0-9]")
    allowed_tokens(kept, kept.initial_state, vocab)  # the cache drops what went as it is next used
    assert not serials & {key[0] for key in cache.masks} and not serials & set(cache.keys_of)
    assert cache.bytes == sum(len(mask) for mask in cache.masks.values())


DECODE_PATTERNS = [
    r'\{"name": "[^"\\]{0,12}", "n": (0|[1-9]\d{0,3}), "tags": \[("[a-zé漢]{1,5}"(, "[a-zé漢]{1,5}"){0,2})?\]\}',
    "[\\u4e00-\\u9fff]{2,5}",
    "(red|green|blue)( and (red|green|blue)){0,2}",
    "\\d{3}-\\d{4}",
    "[😀-😎]{1,3} ?\\w{1,8}",
]


@pytest.mark.parametrize("pattern", DECODE_PATTERNS)
def test_decoding_through_masks_matches(smollm2, pattern):
    tok, token_bytes, eos, vocab = smollm2
    g = Grammar.from_regex(pattern)
    rng = random.Random(99)
    for walk in range(12):
        state, ids = g.initial_state, []
        while not g.is_final(state):
            allowed = np.flatnonzero(mask_bits(allowed_tokens(g, state, vocab), vocab.vocab_size))
            token = int(allowed[0]) if walk == 0 else int(rng.choice(allowed))  # the lowest id, then at random
            if token == eos:
                break
            ids.append(token)
            state = g.advance(state, token_bytes[token])
            assert state != Grammar.DEAD and len(ids) < 200
        assert g.is_accepting(state)
        text = b"".join(token_bytes[i] for i in ids).decode()
        assert re.fullmatch(pattern, text), text
        assert tok.decode(ids) == text


# --- token bytes ------------------------------------------------------------------------------------------

TEXTS = ["plain words, numbers 12345 and  spaces\n\tnext line", "accents: café, naïve, Ångström, ß",
         "CJK: 漢字とかな、한국어", "emoji: 😀👍🏽👨\u200d👩\u200d👧 🇫🇷"]


def test_byte_level_token_bytes(smollm2):
    tok, token_bytes, *_ = smollm2
    assert len(token_bytes) == tok.vocab_size and tok.token_bytes() is token_bytes  # computed once
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes[i] for i in ids) == text.encode()
    assert tok.special_ids and all(token_bytes[i] is None for i in tok.special_ids)
    assert token_bytes[tok.encode(" the", add_special_tokens=False)[0]] == b" the"


def sentencepiece_tokenizer(folder) -> Tokenizer:
    """A Llama-2-style tokenizer: BPE with byte fallback, "▁" for spaces, a Strip of the first space."""
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), "▁", *"helowrdcafé", "▁h", "▁he", "ll", "llo",
              "▁hello", "▁w", "or", "▁wor", "▁c", "▁ca", "▁caf"]
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("ll", "o"), ("▁he", "llo"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("▁", "c"), ("▁c", "a"), ("▁ca", "f")]
    hf = HFTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1)])
    hf.add_special_tokens(specials)
    hf.add_tokens(["<tool>"])
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_sentencepiece_token_bytes(tmp_path):
    tok = sentencepiece_tokenizer(tmp_path)
    token_bytes = tok.token_bytes()
    assert token_bytes[tok.token_id("<0x0A>")] == b"\n" and token_bytes[tok.token_id("▁hello")] == b" hello"
    assert all(token_bytes[tok.token_id(s)] is None for s in ("<unk>", "<s>", "</s>"))
    assert token_bytes[tok.token_id("<tool>")] == b"<tool>"  # an added token that is not special
    for text in ["hello world", "café au lait", "hello 漢字 😀\n", "wörld <tool> ok"]:
        ids = tok.encode(text, add_special_tokens=False)
        # the space "▁" stands for at the very start is the one the decoder strips from a whole text
        assert b"".join(token_bytes[i] for i in ids) == b" " + text.encode()
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_other_decoders_are_refused(tmp_path):
    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    hf.decoder = decoders.WordPiece()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="neither byte-level BPE nor SentencePiece"):
        Tokenizer(tmp_path).token_bytes()
