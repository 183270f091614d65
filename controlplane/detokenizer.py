"""Incremental detokenization and stop strings.

Text is decoded a few tokens at a time, with a little left context so that
tokenizers that drop leading spaces decode correctly; a delta that would end in
half a UTF-8 character (U+FFFD) waits for the next token (the last token sends what
still waits: it decodes as U+FFFD, as in the whole output's text); a character that a prompt
ends halfway through is the output's once its first tokens finish it. Text that could be the
beginning of a stop string is held back until it is known not to be one, so a
stop string never reaches the client, not even in part.
"""

from __future__ import annotations

from twinplane.controlplane.finish import first_stop_string, partial_tag
from twinplane.controlplane.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # left context decoded with each delta


def _new_from(prefix_text: str, new_text: str) -> int:
    """Where the new text starts in new_text: past prefix_text, but for the U+FFFDs at its end that new_text
    has as a character now (a byte-level BPE decodes half a character as one, a byte fallback one a
    byte). Only a prompt ends in half a character (generated text waits for its end):
    the character the first tokens finish is theirs, so the prompt's text less it plus the output's is
    the text of both."""
    start = len(prefix_text)
    while start and prefix_text[start - 1] == "\ufffd" and new_text[start - 1:start] != "\ufffd":
        start -= 1
    return start


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), keep_stop: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.keep_stop = keep_stop  # the matched stop string stays at the end of the text
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.pending = ""  # decoded, not yet sent (may be the start of a stop string)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        self.ids.append(token_id)
        self._read()

    def flush(self) -> None:
        """At the request's last token: the text still waiting for a later token, U+FFFD included
        (no token will complete that character), so that the output is all of its tokens' text."""
        self._read(final=True)

    def _read(self, final: bool = False) -> None:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        start = _new_from(prefix_text, new_text)
        if len(new_text) > start and (final or not new_text.endswith("\ufffd")):
            self.pending += new_text[start:]
            if start == len(prefix_text):  # else read_offset is inside the character just finished: the next
                self.prefix_offset = self.read_offset  # window starts where this one did, on a whole character
            self.read_offset = len(self.ids)
            if self.prefix_offset > 4 * CONTEXT_TOKENS:  # keep the window small
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset, self.read_offset = 0, self.read_offset - drop

    def find_stop(self) -> str | None:
        """The first stop string in the pending text (finish.first_stop_string); the text after it (and it,
        unless keep_stop) is dropped."""
        match = first_stop_string(self.pending, self.stop)
        if match is None:
            return None
        start, matched = match
        self.pending = self.pending[:start + len(matched) if self.keep_stop else start]
        return matched

    def take_text(self, final: bool = False) -> str:
        """Pending text that cannot be part of a stop string (all of it when final)."""
        keep = 0 if final else max((partial_tag(self.pending, s) for s in self.stop), default=0)
        text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return text
