"""Chat templates: the model's Jinja template (as Hugging Face renders it), or a plain default.

The template comes from, in order: an explicit ``--chat-template`` (a file or the template text),
``chat_template.jinja`` in the tokenizer directory, ``chat_template`` in its
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` where ``"default"``
wins), and finally :data:`DEFAULT_CHAT_TEMPLATE` (used for the byte tokenizer). Templates run in
Jinja's immutable sandbox with the globals Hugging Face templates expect.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "ChatTemplateError", "load_chat_template"]

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""One ``role: content`` line per message, then ``assistant:`` to prompt the reply."""


def _render_default(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """:data:`DEFAULT_CHAT_TEMPLATE` rendered without Jinja (same text, a fraction of the cost)."""
    text = "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in messages)
    return text + "assistant:" if add_generation_prompt else text


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template raised, or the messages do not fit it)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return ""


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ImportError(
                "chat templates need jinja2: pip install 'engine-core[server]'"
            ) from exc
        from jinja2 import TemplateError

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template_error = TemplateError
        self._template = env.from_string(source)
        self._is_default = source == DEFAULT_CHAT_TEMPLATE
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text. ``continue_final_message`` leaves the last message open (the text
        ends right after its content) so the model continues it. ``kwargs`` are more variables
        for the template; ``bos_token`` and ``eos_token`` among them override the tokenizer's
        (as in Hugging Face's ``apply_chat_template``), ``messages`` and
        ``add_generation_prompt`` cannot be overridden this way."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        try:
            if self._is_default:
                text = _render_default(messages, add_generation_prompt)
            else:
                variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
                variables["messages"] = messages
                variables["add_generation_prompt"] = add_generation_prompt
                text = self._template.render(variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template choked on these messages or variables
            raise ChatTemplateError(f"the chat template failed: {_short(exc)}") from exc
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or final not in text:
                raise ChatTemplateError(
                    "continue_final_message needs a final message whose text is in the prompt"
                )
            text = text[: text.rindex(final) + len(final)]
        return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _template_from_config(config: dict[str, Any]) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)
        }
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    return None


def load_chat_template(tokenizer_name: str, override: str | None = None) -> ChatTemplate:
    """The chat template for a tokenizer (``"byte"`` or a directory); see the module docstring.
    ``override`` is a path to a template file, or the template text itself."""
    config: dict[str, Any] = {}
    directory = Path(tokenizer_name) if tokenizer_name != "byte" else None
    if directory is not None and directory.is_dir():
        config = _read_json(directory / "tokenizer_config.json")
    source: str | None = None
    if override is not None:
        path = Path(override)
        try:
            is_file = path.is_file()
        except OSError:  # template text too long to be a path
            is_file = False
        source = path.read_text(encoding="utf-8") if is_file else override
    elif directory is not None and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        source = _template_from_config(config)
    if source is None:
        if directory is not None:
            logger.warning("%s has no chat template; using the plain default", directory)
        source = DEFAULT_CHAT_TEMPLATE
    return ChatTemplate(
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )
