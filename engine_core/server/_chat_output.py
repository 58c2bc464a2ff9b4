"""A chat completion's text read as a message: the thinking split off (``--reasoning-parser``)
and tool calls read out of the rest (the ``tool_choice``'s parser), whole or as it streams."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from engine_core._core.tokenizer import Tokenizer
from engine_core.outputs import CompletionOutput
from engine_core.server._protocol import (
    AssistantMessage,
    CompletionTokensDetails,
    Delta,
    FunctionCall,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
)
from engine_core.server._reasoning import ReasoningParser, ReasoningStream
from engine_core.server.tools import ToolCallDelta as ToolCallPiece
from engine_core.server.tools import (
    ToolCallStream,
    ToolParser,
    extract_tool_calls,
    new_call_id,
)

__all__ = ["ChatReader", "ChoiceStream", "OutputPart", "Thought"]


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


@dataclass(slots=True)
class ChatReader:
    """How one request's outputs are read (shared by its choices); counts the thinking."""

    tokenizer: Tokenizer
    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    parallel: bool = True
    """``parallel_tool_calls``: false keeps the first call of an output only."""
    tool_names: Collection[str] | None = None
    """The functions the request offers (None: any): a call to another one is content."""
    reasoning_tokens: int = 0
    _streams: dict[int, ChoiceStream] = field(default_factory=dict)

    def usage_details(self) -> CompletionTokensDetails | None:
        """The thinking's share of the usage (None without a reasoning parser)."""
        if self.reasoning is None:
            return None
        streamed = sum(stream.reasoning_tokens for stream in self._streams.values())
        return CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens + streamed)

    def message(self, completion: CompletionOutput) -> tuple[AssistantMessage, str | None]:
        """The message and finish reason of a whole completion."""
        text = completion.text
        reasoning = None
        if self.reasoning is not None:
            reasoning, text, _ = self.reasoning.split(text, final=True)
            self.reasoning_tokens += self.reasoning.reasoning_tokens(
                self.tokenizer, completion.token_ids
            )
            reasoning = reasoning or None
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            text, found = extract_tool_calls(self.tool_parser, text, self.tool_names)
            if not self.parallel:
                found = found[:1]
            calls = [
                ToolCall(
                    id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)
                )
                for c in found
            ]
        content: str | None = text
        if calls:
            content = text.strip() or None
        elif self.reasoning is not None:
            content = text or None  # all of it was thinking
        message = AssistantMessage(
            content=content, reasoning_content=reasoning, tool_calls=calls or None
        )
        return message, _finish_reason(completion.finish_reason, bool(calls))

    def stream(self, index: int) -> ChoiceStream:
        """The stream of choice ``index`` (made on first use)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ChoiceStream(self)
        return stream


@dataclass(frozen=True, slots=True)
class Thought:
    """A piece of an output's thinking (the other parts are content, as strings, and calls)."""

    text: str


OutputPart = Thought | str | ToolCallPiece
"""A piece of a streamed choice, in the text's order: thinking, content or a whole call."""


class ChoiceStream:
    """One streamed choice: each output's text becomes its parts (thinking, content, calls, in
    order) or, as a chat stream sends them, a delta."""

    def __init__(self, reader: ChatReader) -> None:
        self.reasoning = (
            ReasoningStream(reader.reasoning, reader.tokenizer)
            if reader.reasoning is not None
            else None
        )
        self.tools = (
            ToolCallStream(reader.tool_parser, reader.tool_names) if reader.tool_parser else None
        )
        self.parallel = reader.parallel

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning is not None else 0

    def parts(self, completion: CompletionOutput) -> tuple[list[OutputPart], str | None]:
        """The parts of one output and the finish reason."""
        text = completion.text
        final = completion.finish_reason is not None
        parts: list[OutputPart] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, completion.token_ids, final)
            if thought:
                parts.append(Thought(thought))
        if self.tools is None:
            if text:
                parts.append(text)
        else:
            for part in self.tools.feed(text, final):
                if isinstance(part, str) or part.index == 0 or self.parallel:
                    parts.append(part)
        has_calls = self.tools is not None and self.tools.has_calls
        return parts, _finish_reason(completion.finish_reason, has_calls)

    def delta(self, completion: CompletionOutput) -> tuple[Delta | None, str | None]:
        """The delta of one output (None: nothing new) and the finish reason."""
        if self.reasoning is None and self.tools is None:  # plain text: as it comes
            text = completion.text
            return (Delta(content=text) if text else None), completion.finish_reason
        parts, reason = self.parts(completion)
        if not parts:
            return None, reason
        reasoning = "".join(p.text for p in parts if isinstance(p, Thought))
        content = "".join(p for p in parts if isinstance(p, str))
        calls = [
            ToolCallDelta(
                index=p.index,
                id=p.id,
                type="function",
                function=FunctionDelta(name=p.name, arguments=p.arguments),
            )
            for p in parts
            if isinstance(p, ToolCallPiece)
        ]
        delta = Delta(
            content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )
        return delta, reason
