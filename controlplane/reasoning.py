"""Splits a chat completion's text into its reasoning and its answer (``--reasoning-parser``).

Reasoning models write their thinking between ``<think>`` and ``</think>``, then the answer. The
OpenAI-compatible API returns the two apart, as vLLM's reasoning parsers do: the thinking as the
message's (or the delta's) ``reasoning_content``, the rest as ``content``. The tags themselves go in
neither.

- ``qwen3``: the text is reasoning only when it opens with ``<think>`` (whitespace before it
  allowed); else all of it is the answer. Qwen3 opens its thinking itself, and writes none when
  asked not to (``chat_template_kwargs: {"enable_thinking": false}``).
- ``deepseek_r1``: the text starts inside the reasoning (the chat template opened it in the
  prompt), so everything up to ``</think>`` is reasoning, all of it when ``</think>`` never comes.
  A ``<think>`` the model writes anyway at the very start is dropped.

Either parser first looks at how the prompt ends (``after_prompt``): a prompt that ends with ``<think>``
(a chat template that opens the thinking: Qwen3's thinking-only models, QwQ; a continued final message
"<think>") puts the text in the reasoning from its first character, up to ``</think>``; one that ends
with ``</think>`` (thinking turned off) puts all of it in the answer.

Text arrives in pieces; a piece that may be the start of a tag waits for the next one, so the
pieces of either part, joined, equal the split of the whole text.
"""

from __future__ import annotations

from twinplane.controlplane.finish import partial_tag

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


PROMPT_TAIL_TOKENS = 64  # the prompt's last tokens whose text says whether it opened or closed the thinking


def prompt_state(tail: str) -> str | None:
    """Where the text after a prompt ending in tail starts: "reasoning" when the prompt ends with <think>
    (whitespace after it allowed), "content" when it ends with </think>; None otherwise (the text says).
    Only the very end counts: a tag mentioned earlier (a user asking about <think>) says nothing."""
    tail = tail.rstrip()
    if tail.endswith(CLOSE):
        return "content"
    return "reasoning" if tail.endswith(OPEN) else None


class ReasoningSplitter:
    """One choice's text, fed piece by piece, split into (reasoning, content) pieces."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self.state = "opening"  # before the text shows whether (qwen3) or how (deepseek_r1) reasoning opens
        self.unopened = "reasoning" if parser == "deepseek_r1" else "content"  # where text without <think> goes
        self.held = ""  # text that may be the start of a tag

    def after_prompt(self, tail: str) -> None:
        """Starts the text where a prompt ending in tail leaves it (before the first feed): in the reasoning
        after an opened <think> (one the model writes anyway at the start is dropped, as deepseek_r1's),
        in the answer after a closed one."""
        state = prompt_state(tail) if self.state == "opening" else None
        if state == "reasoning":
            self.unopened = "reasoning"
        elif state == "content":
            self.state = "content"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content in text (with what was held before); final: the text ends here."""
        text, self.held = self.held + text, ""
        reasoning = content = ""
        if self.state == "opening":
            stripped = text.lstrip() if self.parser == "qwen3" else text
            if stripped.startswith(OPEN):
                text, self.state = stripped[len(OPEN):], "reasoning"
            elif OPEN.startswith(stripped) and not final:  # still undecided (empty, or a start of "<think>")
                self.held = text
                return "", ""
            else:
                self.state = self.unopened
        if self.state == "reasoning":
            before, closed, after = text.partition(CLOSE)
            if closed:
                reasoning, text, self.state = before, after, "content"
            else:
                keep = 0 if final else partial_tag(text, CLOSE)
                reasoning, self.held, text = text[:len(text) - keep], text[len(text) - keep:], ""
        if self.state == "content":
            content = text
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str, str]:
    """The reasoning and the content of a whole text."""
    return ReasoningSplitter(parser).feed(text, final=True)
