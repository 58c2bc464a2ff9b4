"""Scripted replies: the mock answers a prompt that matches a regex with a given text.

``backend_options={"replies": [{"match": "<regex>", "text": "..."}, ...]}``: the first entry
whose ``match`` is found (``re.search``) in the prompt's text (decoded with the served tokenizer,
special tokens kept) gives the reply. Its text, tokenized with the served tokenizer, comes out
token by token and then the first EOS id (``"eos": false`` leaves it out); past the reply (with
``ignore_eos``, say) the usual token rule goes on. A grammar bitmask or a mask moves a reply
token to the next allowed one, as it moves the rule's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_core.abc import Tokenizer, load_tokenizer

__all__ = ["Replies", "parse_replies"]

_KEYS = frozenset({"match", "text", "eos"})


@dataclass(frozen=True, slots=True)
class Reply:
    pattern: re.Pattern[str]
    text: str
    eos: bool


def parse_replies(value: Any) -> tuple[Reply, ...]:
    """The ``replies`` option checked: a list of ``{"match": regex, "text": str}`` (and an
    optional ``"eos": bool``); ``ValueError`` naming the entry otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"backend_options['replies'] must be a list, got {value!r}")
    replies = []
    for index, entry in enumerate(value):
        where = f"backend_options['replies'][{index}]"
        if not isinstance(entry, dict) or not {"match", "text"} <= set(entry) <= _KEYS:
            raise ValueError(
                f"{where} must be a dict with the keys 'match' and 'text' (and optionally "
                f"'eos'), got {entry!r}"
            )
        match, text, eos = entry["match"], entry["text"], entry.get("eos", True)
        if not isinstance(match, str) or not isinstance(text, str) or not isinstance(eos, bool):
            raise ValueError(f"{where}: 'match' and 'text' must be strings, 'eos' a bool")
        try:
            pattern = re.compile(match)
        except re.error as exc:
            raise ValueError(f"{where}['match'] is not a valid regex: {exc}") from None
        replies.append(Reply(pattern, text, eos))
    return tuple(replies)


class Replies:
    """The scripted replies of one backend, with the tokenizer they are read and written with
    (loaded on the first request)."""

    def __init__(self, replies: tuple[Reply, ...], tokenizer_name: str) -> None:
        self._replies = replies
        self._tokenizer_name = tokenizer_name
        self._tokenizer: Tokenizer | None = None
        self._encoded: dict[int, list[int]] = {}

    def tokens_for(self, prompt_token_ids: Sequence[int]) -> list[int] | None:
        """The reply's token ids for a prompt (None: no entry matches it)."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = self._tokenizer = load_tokenizer(self._tokenizer_name)
        prompt = tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        for index, reply in enumerate(self._replies):
            if reply.pattern.search(prompt):
                if index not in self._encoded:
                    self._encoded[index] = self._encode(tokenizer, reply)
                return self._encoded[index]
        return None

    @staticmethod
    def _encode(tokenizer: Tokenizer, reply: Reply) -> list[int]:
        ids = tokenizer.encode(reply.text)
        bos = tokenizer.bos_token_id
        if ids and bos is not None and ids[0] == bos:
            del ids[0]  # the tokenizer's own BOS: a reply continues the prompt
        if reply.eos and tokenizer.eos_token_ids:
            ids.append(tokenizer.eos_token_ids[0])
        return ids
