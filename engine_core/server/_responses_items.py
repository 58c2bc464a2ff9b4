"""The output items of a ``/v1/responses`` answer and their semantic stream events, made from
the parts of its output (thinking, content, whole tool calls) in the order they come:
a streamed response sends the events as it goes, a whole one keeps only the items, so both
list the same items. Content of white space alone between items (after a call, before the
first text) opens no message item."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from engine_core.server._chat_output import OutputPart, Thought
from engine_core.server._sse import sse_event
from engine_core.server.tools import ToolCallDelta

__all__ = ["OutputItems", "item_id"]

_ENCODER = msgspec.json.Encoder()


def item_id(prefix: str) -> str:
    """A fresh id of an output item (or response): ``prefix``, an underscore, 24 hex digits."""
    return f"{prefix}_{secrets.token_hex(12)}"


class OutputItems:
    """The items of one response as its parts come (:meth:`add`, then :meth:`close`), each
    call giving the encoded events that say so; ``sequence`` numbers them."""

    def __init__(self, sequence: int = 0) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence = sequence
        self._open: dict[str, Any] | None = None
        self._space = ""
        """White space held back: it opens no message item unless more text follows."""

    def event(self, kind: str, **fields: Any) -> bytes:
        """One event, numbered."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(_ENCODER.encode(data))

    def add(self, parts: list[OutputPart]) -> list[bytes]:
        """The events of an output's parts."""
        events: list[bytes] = []
        for part in parts:
            if isinstance(part, Thought):
                self._text_delta("reasoning", part.text, events)
            elif isinstance(part, str):
                self._content(part, events)
            else:
                self._call(part, events)
        return events

    def _content(self, text: str, events: list[bytes]) -> None:
        if self._open is None or self._open["type"] != "message":
            text = self._space + text
            self._space = ""
            if not text.strip():
                self._space = text  # opens no message item unless more text follows
                return
        self._text_delta("message", text, events, logprobs=[])

    def _call(self, call: ToolCallDelta, events: list[bytes]) -> None:
        events.extend(self.close())
        self._space = ""
        item: dict[str, Any] = {
            "type": "function_call",
            "id": item_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self._add_item(item, events)
        item["arguments"] = call.arguments
        events.append(
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                delta=call.arguments,
            )
        )

    def _text_delta(self, kind: str, text: str, events: list[bytes], **extra: Any) -> None:
        """Append ``text`` to the open item of ``kind`` (``reasoning`` or ``message``) and its
        delta event to ``events``."""
        item = self._ensure(kind, events)
        item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append(
            self.event(
                f"response.{name}.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **extra,
            )
        )

    def _ensure(self, kind: str, events: list[bytes]) -> dict[str, Any]:
        """The open item of ``kind``, opened now (closing another) when needed."""
        if self._open is not None and self._open["type"] == kind:
            return self._open
        events.extend(self.close())
        part_type = "reasoning_text" if kind == "reasoning" else "output_text"
        part: dict[str, Any] = {"type": part_type, "text": ""}
        item: dict[str, Any]
        if kind == "message":
            part["annotations"] = []
            item = {
                "type": "message",
                "id": item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": []}
        self._add_item(item, events)
        if kind == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part=dict(part),
                )
            )
        item["content"].append(part)
        return item

    def _add_item(self, item: dict[str, Any], events: list[bytes]) -> None:
        self.items.append(item)
        self._open = item
        events.append(
            self.event(
                "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
            )
        )

    def close(self) -> list[bytes]:
        """The events that close the open item (none when none is open)."""
        item = self._open
        if item is None:
            return []
        self._open = None
        output_index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": output_index}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        if item["type"] == "reasoning":
            del item["status"]
        events.append(self.event("response.output_item.done", output_index=output_index, item=item))
        return events
