"""One choice's chat text split, piece by piece, into its reasoning (``--reasoning-parser``), its
content and the tool calls it makes (``--tool-call-parser``): what the OpenAI-compatible APIs
return apart, and what a gRPC request with ``parse_output`` gets."""

from __future__ import annotations

from twinplane.controlplane.reasoning import ReasoningSplitter
from twinplane.controlplane.tools import ToolCall, parser_for


class ChatText:
    """One choice's chat text, piece by piece, split into its reasoning (``--reasoning-parser``),
    its content and its tool calls (``--tool-call-parser``, when the request lets the model call
    tools); ``parallel`` false keeps the first call only."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, parallel: bool = True):
        self.reasoning = ReasoningSplitter(reasoning_parser) if reasoning_parser else None
        self.tools = parser_for(tool_call_parser) if tool_call_parser else None
        self.parallel = parallel
        self.calls = 0  # tool calls so far: the next one's index
        self.reasoning_tokens = 0  # the tokens of the pieces that were reasoning (tags included)
        self.undecided_tokens = 0  # tokens of pieces held while the text may still open reasoning

    def feed(self, text: str, final: bool = False, num_tokens: int = 0) -> tuple[str, str, list[ToolCall]]:
        """The reasoning, the content and the tool calls in text, the piece of num_tokens tokens. A
        piece that held both reasoning and content (several tokens at once) counts its tokens
        toward the reasoning by its share of the characters."""
        reasoning, calls = "", []
        if self.reasoning is not None:
            was = self.reasoning.state
            reasoning, text = self.reasoning.feed(text, final)
            num_tokens, self.undecided_tokens = num_tokens + self.undecided_tokens, 0
            if self.reasoning.state == "opening":
                self.undecided_tokens = num_tokens
            elif "reasoning" in (was, self.reasoning.state) or reasoning:
                share = len(reasoning) / (len(reasoning) + len(text)) if text else 1.0
                self.reasoning_tokens += round(num_tokens * share)
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
            calls = calls if self.parallel else calls[:max(0, 1 - self.calls)]
            self.calls += len(calls)
        return reasoning, text, calls
