"""What ``tools`` and ``tool_choice`` ask of a request: the checked tools, and with
``"required"`` or a named function the grammar that constrains the output to calls (built from
the tools' JSON schemas, so the arguments always parse and validate) and the parser that reads
them back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_core._core.checks import MAX_JSON_DEPTH, check_json_value
from engine_core.sampling_params import StructuredOutputsParams
from engine_core.server._errors import APIError
from engine_core.server.tools._calls import (
    Parsed,
    is_object,
    read_objects,
    skip_space,
    value_end,
)
from engine_core.server.tools._parser import ToolParser

__all__ = [
    "MAX_REQUIRED_TOOLS",
    "FunctionTool",
    "ToolChoice",
    "call_list_schema",
    "read_tool_choice",
    "read_tools",
]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as chat templates expect it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def read_tools(tools: list[dict[str, Any]] | None, param: str = "tools") -> list[FunctionTool]:
    """The function tools of a request (chat's ``{"type": "function", "function": {...}}`` or
    the Responses API's flat ``{"type": "function", "name", ...}``); 400 naming ``param``."""
    found = []
    for index, tool in enumerate(tools or ()):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where}: only function tools are supported", param=param)
        function = tool.get("function", tool)
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}: a function needs a name", param=param)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = dict(_ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}: parameters must be a JSON schema object", param=param)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{where}: description must be a string", param=param)
        found.append(FunctionTool(name, parameters, description))
    names = [tool.name for tool in found]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct names", param=param)
    return found


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a request's ``tool_choice`` comes to."""

    mode: str
    """``"none"``, ``"auto"``, ``"required"`` or ``"named"``."""
    tools: list[FunctionTool]
    name: str | None = None
    """The function of ``"named"``."""
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of ``"required"`` and ``"named"`` (None for the others); 400 naming
        ``tools`` for tools whose schemas no grammar can be built from."""
        if self.mode == "named":
            index, tool = next((i, t) for i, t in enumerate(self.tools) if t.name == self.name)
            return _schema_params(tool.parameters, index, 0)
        if self.mode != "required":
            return None
        if len(self.tools) > MAX_REQUIRED_TOOLS:
            raise APIError(
                400,
                f'tool_choice "required" chooses among at most {MAX_REQUIRED_TOOLS} tools, got '
                f"{len(self.tools)}: the grammar's parser (llguidance) keeps at most 2000 items "
                "per row, one per tool; offer fewer tools, or name the function",
                param="tools",
            )
        for index, tool in enumerate(self.tools):  # the call list nests each schema deeper
            _schema_params(tool.parameters, index, _CALL_LIST_DEPTH)
        return StructuredOutputsParams(json=call_list_schema(self.tools, self.parallel))

    def parser(self, auto: ToolParser | None) -> ToolParser | None:
        """The parser that reads this choice's calls back (``auto``: the server's)."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCallParser(self.name)
        if self.mode == "required":
            return CallListParser()
        return auto if self.mode == "auto" else None


def read_tool_choice(
    choice: str | dict[str, Any] | None,
    tools: list[FunctionTool],
    parallel: bool | None,
    *,
    auto_enabled: bool,
    param: str = "tool_choice",
) -> ToolChoice:
    """The request's choice; 400 naming ``param`` for one that is unknown, names no tool, or
    (``"auto"``) needs a parser the server was not started with."""
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        function = choice.get("function", choice)
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                f'{param} must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                param=param,
            )
        if name not in {tool.name for tool in tools}:
            raise APIError(
                400, f"{param} names {name!r}, which is not among the tools", param=param
            )
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise APIError(
            400, f'{param} must be "none", "auto", "required" or a function', param=param
        )
    if mode in ("required", "auto") and not tools:
        if mode == "required":
            raise APIError(400, f'{param} "required" needs tools', param=param)
        mode = "none"
    if mode == "auto" and not auto_enabled:
        raise APIError(
            400,
            f'{param} "auto" needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser",
            param=param,
        )
    return ToolChoice(mode, tools, name, parallel is not False)


MAX_REQUIRED_TOOLS = 1900
"""The most tools ``"required"`` chooses among: llguidance's Earley parser refuses a row of
more than 2000 items, and the call list's first row holds one per tool (and a few more)."""
_CALL_LIST_DEPTH = 5
"""How deep the call list of ``"required"`` puts each tool's parameters: the array, its
``items``, ``anyOf``, a call object, its ``properties``."""


def call_list_schema(tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``"required"``'s output: a list of calls to ``tools`` (at most one
    unless ``parallel``)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _schema_params(schema: dict[str, Any], index: int, depth: int) -> StructuredOutputsParams:
    """``schema`` (tool ``index``'s parameters) as a JSON constraint, checked as if nested
    ``depth`` levels deeper; 400 naming ``tools`` when it is too deep (or otherwise invalid)."""
    try:
        check_json_value("schema", schema, MAX_JSON_DEPTH - depth)
        return StructuredOutputsParams(json=schema)
    except (ValueError, TypeError) as exc:
        reason = str(exc).removeprefix("structured_outputs.json").removeprefix("schema")
        where = f"tools[{index}]: its parameters schema"
        if depth:
            reason += f' (tool_choice "required" nests them {depth} levels deeper in its call list)'
        raise APIError(400, f"{where}{reason}", param="tools", code="invalid_value") from None


class NamedCallParser(ToolParser):
    """The output of a named ``tool_choice``: the whole text is the arguments of one call,
    complete once its object closes."""

    def __init__(self, name: str) -> None:
        self.function = name

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if pos == len(text):
            return Parsed().rest_is_content(text, 0) if final else Parsed()
        end = value_end(text, pos) if text[pos] == "{" else None
        if end is None:
            if final or text[pos] != "{":
                return Parsed().rest_is_content(text, 0)
            return Parsed()
        if not is_object(text[pos:end]):
            return Parsed().rest_is_content(text, 0)
        parsed = Parsed()
        parsed.add(self.function, text[pos:end], start=0)
        if skip_space(text, end) < len(text):
            parsed.rest_is_content(text, end)
        return parsed


class CallListParser(ToolParser):
    """The output of ``"required"``: ``[{"name": ..., "parameters": {...}}, ...]``; the calls
    before a cut or a break stand."""

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if pos == len(text):
            return Parsed().rest_is_content(text, 0) if final else Parsed()
        if text[pos] != "[":
            return Parsed().rest_is_content(text, 0)
        return read_objects(
            text, pos + 1, final, Parsed(), separator=",", closing="]", markup_start=0
        )
