"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from twinplane.controlplane.detokenizer import IncrementalDetokenizer
from twinplane.controlplane.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def stream(tokenizer, text: str, stop=()) -> tuple[list[str], str | None]:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), True, stop)
    deltas = []
    for token_id in ids:
        detok.add_token(token_id)
        matched = detok.find_stop()
        if matched is not None:
            deltas.append(detok.take_text(final=True))
            return deltas, matched
        deltas.append(detok.take_text())
    deltas.append(detok.take_text(final=True))
    return deltas, None


@pytest.mark.parametrize("text", ["Hello world, how are you?", "naïve café — 東京 🙂 done", "  spaced   out\n\nlines"])
def test_deltas_join_to_the_full_text_and_are_whole_characters(tokenizer, text):
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text))
    assert all("\ufffd" not in d for d in deltas)


def test_a_long_output_decodes_a_bounded_window_of_tokens(tokenizer):
    """Each token decodes only the last few tokens (left context included), not the whole output so far: a
    long stream costs the same per token, and its text is still the whole output's."""
    from twinplane.controlplane.detokenizer import CONTEXT_TOKENS

    ids = tokenizer.encode("naïve café — 東京 🙂 done, and so on. " * 80)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    text, widest = "", 0
    for token_id in ids:
        detok.add_token(token_id)
        text += detok.take_text()
        widest = max(widest, len(detok.ids))
    assert widest <= 5 * CONTEXT_TOKENS + 2
    assert text + detok.take_text(final=True) == tokenizer.decode(ids)


def test_emoji_split_over_tokens_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # byte-level pieces
    deltas, _ = stream(tokenizer, "🙂")
    assert [d for d in deltas if d] == ["🙂"]


def _after_prompt(tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """The deltas of output's tokens after prompt, the last token's flush included."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for token_id in output:
        detok.add_token(token_id)
        deltas.append(detok.take_text())
    detok.flush()
    return deltas + [detok.take_text(final=True)]


@pytest.mark.parametrize("cut", [1, 2])
def test_a_character_the_prompt_ends_halfway_through_is_the_outputs_once_finished(tokenizer, cut):
    """A token-id prompt may end inside a character (a generation cut short and sent back): the first
    tokens finish it, and it is theirs, so the prompt's text less its unfinished end plus the output's
    is the text of all the tokens."""
    ids = tokenizer.encode("Faces: 🙂 🤩 and more")  # 🤩 is three byte-level tokens
    first = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("\ufffd"))
    prompt, output = ids[:first + cut], ids[first + cut:]  # cut after its first one or two
    prompt_text = tokenizer.decode(prompt)
    assert prompt_text.endswith("\ufffd")
    deltas = _after_prompt(tokenizer, prompt, output)
    assert prompt_text.removesuffix("\ufffd") + "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_emitted_in_part(tokenizer):
    deltas, matched = stream(tokenizer, "The answer is STOP here and more", stop=("STOP",))
    assert matched == "STOP"
    assert "".join(deltas) == "The answer is "
    assert not any("S" in d for d in deltas)


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    deltas, matched = stream(tokenizer, "ST and STO but no stop", stop=("STOP",))
    assert matched is None
    assert "".join(deltas) == "ST and STO but no stop"


def test_chat_template_matches_transformers(tokenizer, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.render_chat(messages) == expected


class _ByteFallback:
    """A tokenizer of single characters and <0xHH> byte tokens, decoded as SentencePiece's byte fallback
    does: a run of byte tokens that is no valid UTF-8 gives one U+FFFD a byte."""

    def __init__(self, pieces: list[str | int]) -> None:
        self.pieces = pieces  # a token's id is its index: a character, or a byte

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text, run = [], b""
        for piece in [self.pieces[i] for i in ids] + [""]:
            if isinstance(piece, int):
                run += bytes([piece])
                continue
            try:
                text.append(run.decode())
            except UnicodeDecodeError:
                text.append("\ufffd" * len(run))
            text.append(piece)
            run = b""
        return "".join(text)


@pytest.mark.parametrize("cut, after", [(1, "€éY"), (3, "")], ids=["then-more", "last-token"])
def test_a_byte_fallback_tokenizer_after_a_prompt_that_ends_halfway_through_a_character(cut, after):
    """The character the output finishes is the output's (also as its last token), and the characters
    after it decode whole."""
    tok = _ByteFallback(["X", "Y", *range(256)])
    byte = lambda b: 2 + b  # noqa: E731
    emoji = "🤩".encode()
    prompt = [0, *(byte(b) for b in emoji[:cut])]  # "X" and the first bytes of 🤩
    output = [byte(b) for b in emoji[cut:] + after.removesuffix("Y").encode()] + ([1] if after else [])
    assert "".join(_after_prompt(tok, prompt, output)) == "🤩" + after
