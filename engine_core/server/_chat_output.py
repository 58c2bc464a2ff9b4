"""A chat completion's text read as a message: the thinking split off (``--reasoning-parser``)
and tool calls read out of the rest (the ``tool_choice``'s parser), whole or as it streams."""

from __future__ import annotations

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
from engine_core.server.tools import (
    ToolCallStream,
    ToolParser,
    extract_tool_calls,
    new_call_id,
)

__all__ = ["ChatReader", "ChoiceStream"]


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
            text, found = extract_tool_calls(self.tool_parser, text)
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


class ChoiceStream:
    """One streamed choice: each output's text becomes a delta of reasoning, content and
    tool-call pieces."""

    def __init__(self, reader: ChatReader) -> None:
        self.reasoning = (
            ReasoningStream(reader.reasoning, reader.tokenizer)
            if reader.reasoning is not None
            else None
        )
        self.tools = ToolCallStream(reader.tool_parser) if reader.tool_parser else None
        self.parallel = reader.parallel

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning is not None else 0

    def delta(self, completion: CompletionOutput) -> tuple[Delta | None, str | None]:
        """The delta of one output (None: nothing new) and the finish reason."""
        text = completion.text
        if self.reasoning is None and self.tools is None:  # plain text: as it comes
            return (Delta(content=text) if text else None), completion.finish_reason
        final = completion.finish_reason is not None
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, completion.token_ids, final)
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            text, pieces = self.tools.feed(text, final)
            for piece in pieces:
                if piece.index > 0 and not self.parallel:
                    continue
                function = FunctionDelta(name=piece.name, arguments=piece.arguments)
                calls.append(
                    ToolCallDelta(
                        index=piece.index,
                        id=piece.id,
                        type="function" if piece.id is not None else None,
                        function=function,
                    )
                )
        has_calls = self.tools is not None and self.tools.has_calls
        reason = _finish_reason(completion.finish_reason, has_calls)
        if not (reasoning or text or calls):
            return None, reason
        delta = Delta(
            content=text or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )
        return delta, reason
