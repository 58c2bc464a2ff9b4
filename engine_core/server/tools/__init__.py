"""Tool calling for the chat endpoints: parsers of models' tool-call formats (a registry, one
module per format), their streaming, and the grammars that ``tool_choice`` asks for."""

from engine_core.server.tools._parser import (
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from engine_core.server.tools._stream import (
    ExtractedCall,
    ToolCallDelta,
    ToolCallStream,
    extract_tool_calls,
    new_call_id,
)

__all__ = [
    "ExtractedCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "extract_tool_calls",
    "get_tool_parser",
    "new_call_id",
    "register_tool_parser",
    "tool_parser_names",
]
