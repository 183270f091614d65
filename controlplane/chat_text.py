"""One choice's chat text split, piece by piece, into its reasoning (``--reasoning-parser``), its
content and the tool calls it makes (``--tool-call-parser``): what the OpenAI-compatible APIs
return apart, and what a gRPC request with ``parse_output`` gets."""

from __future__ import annotations

from typing import NamedTuple

from twinplane.controlplane.reasoning import PROMPT_TAIL_TOKENS, ReasoningSplitter
from twinplane.controlplane.tools import ToolCall, parser_for


class CallDelta(NamedTuple):
    """What a piece of text adds to one tool call, for a stream."""

    index: int  # the call's place among the choice's calls
    call: ToolCall  # the call so far: its id, name and arguments up to this piece
    arguments: str  # the arguments' text this piece adds
    begins: bool  # the call's first delta: its id and name go with it
    ends: bool  # the call is whole

    @property
    def adds(self) -> bool:
        """Whether a stream sends it: the call's start or text of its arguments (its end alone adds nothing)."""
        return self.begins or bool(self.arguments)


class ChatText:
    """One choice's chat text, piece by piece, split into its reasoning (``--reasoning-parser``),
    its content and its tool calls (``--tool-call-parser``, when the request lets the model call
    tools); ``parallel`` false keeps the first call only. ``calls_only``: the output is nothing but
    tool calls (tool_choice forces them), so what the parser leaves as content is the markup of a call
    cut short (by max_tokens) and is dropped."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, parallel: bool = True,
                 calls_only: bool = False, tokenizer=None):
        """tokenizer: reads how the prompt ends (the first output's prompt ids), where the reasoning starts."""
        self.reasoning = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.tokenizer = tokenizer
        self.tools = parser_for(tool_call_parser) if tool_call_parser else None
        self.parallel = parallel
        self.calls_only = calls_only
        self.calls = 0  # tool calls so far: the next one's index
        self.reasoning_tokens = 0  # the tokens of the pieces that were reasoning (tags included)
        self.undecided_tokens = 0  # tokens of pieces held whole (the text may still open reasoning, or a tag)
        self.streamed: tuple[str, int] | None = None  # the open call's id, and how much of its arguments went out
        self.call_offsets: list[int] = []  # the last feed's calls: how much of its content came before each

    def take(self, out) -> tuple[str, str, list[ToolCall]]:
        """``feed`` of one RequestOutput; the first, which carries the prompt's ids, starts the text where
        the prompt leaves it (``reasoning.py``)."""
        if self.reasoning is not None and out.prompt_ids and self.tokenizer is not None:
            self.reasoning.after_prompt(self.tokenizer.decode(out.prompt_ids[-PROMPT_TAIL_TOKENS:], False))
        return self.feed(out.text, out.finish_reason is not None, len(out.token_ids))

    def feed(self, text: str, final: bool = False, num_tokens: int = 0) -> tuple[str, str, list[ToolCall]]:
        """The reasoning, the content and the tool calls in text, the piece of num_tokens tokens. A
        piece that held both reasoning and content (several tokens at once) counts its tokens
        toward the reasoning by the share of its characters that were not content (the tags are
        reasoning)."""
        reasoning, calls = "", []
        if self.reasoning is not None:
            pending = len(self.reasoning.held) + len(text)  # characters to split, with those held before
            reasoning, text = self.reasoning.feed(text, final)
            num_tokens, self.undecided_tokens = num_tokens + self.undecided_tokens, 0
            decided = pending - len(self.reasoning.held)
            if self.reasoning.state == "opening" or not decided:  # all of it held: its tokens count with the next
                self.undecided_tokens = num_tokens
            else:  # what is not content was reasoning, its tags included
                self.reasoning_tokens += round(num_tokens * (decided - len(text)) / decided)
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
            text = "" if self.calls_only else text
            calls = calls if self.parallel else calls[:max(0, 1 - self.calls)]
            self.call_offsets = [min(offset, len(text)) for offset in self.tools.call_offsets[:len(calls)]]
            self.calls += len(calls)
        return reasoning, text, calls

    def deltas(self, calls: list[ToolCall]) -> list[CallDelta]:
        """For a stream, right after ``feed`` gave calls: what the piece adds to each call, the calls it
        completed and then the one still being written (whose arguments go out as they come)."""
        first = self.calls - len(calls)
        deltas = [self._delta(first + k, call, ends=True) for k, call in enumerate(calls)]
        writing = self.tools.open_call if self.tools is not None and (self.parallel or not self.calls) else None
        if writing is not None:
            delta = self._delta(self.calls, writing, ends=False)
            if delta.adds:
                deltas.append(delta)
        return deltas

    def _delta(self, index: int, call: ToolCall, ends: bool) -> CallDelta:
        begins = self.streamed is None or self.streamed[0] != call.id
        sent = 0 if begins else self.streamed[1]
        self.streamed = None if ends else (call.id, len(call.arguments))
        return CallDelta(index, call, call.arguments[sent:], begins, ends)
