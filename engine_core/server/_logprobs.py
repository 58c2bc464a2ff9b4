"""Logprobs as the completion endpoints write them: the legacy completions columns (with the
echoed prompt's logprobs, as ``lm-eval`` reads them), chat's token entries with their bytes, and
vLLM's ``prompt_logprobs``.

Every candidate the engine returns is an entry of its own. The completions columns key a
position's candidates by text, and distinct tokens may show the same text (the bytes of one
character split over several tokens all show U+FFFD): a later candidate whose text is taken is
keyed by its bytes, as OpenAI writes such tokens (``bytes:\\xe2\\x80``), or by its id.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core._core.tokenizer import Tokenizer, output_decoder
from engine_core.outputs import Logprob, PositionLogprobs
from engine_core.sampling_params import SamplingParams
from engine_core.server._protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "LOWEST_LOGPROB",
    "TextOffsets",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_logprobs",
]

LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf is written as (JSON has no infinity), as vLLM writes it."""


def _clamped(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


class TextOffsets:
    """Where the text of each token of one choice begins in the choice's text (``text_offset``).

    Only text that appears counts: a skipped special token moves nothing, and the tokens of a
    character split over several begin where the character does. The tokens are decoded again
    in the choice's context (after ``context`` ids), as the engine decoded them for its text;
    ``start`` is where the first one begins (after an echoed prompt).
    """

    __slots__ = ("_decoder", "offset")

    def __init__(
        self, tokenizer: Tokenizer, context: list[int], params: SamplingParams, start: int = 0
    ) -> None:
        self._decoder = output_decoder(
            tokenizer, context, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.offset = start

    def of(self, token_ids: Sequence[int]) -> list[int]:
        """The offsets of the next ``token_ids``."""
        offsets = []
        step = self._decoder.step
        for token_id in token_ids:
            offsets.append(self.offset)
            self.offset += len(step(token_id))
        return offsets


def _candidate_key(tokenizer: Tokenizer, token_id: int, text: str, taken: dict[str, float]) -> str:
    """The key of a candidate in a completions ``top_logprobs`` dict: its text, unless an
    earlier candidate has it."""
    if text not in taken:
        return text
    key = "bytes:" + "".join(f"\\x{b:02x}" for b in tokenizer.token_bytes(token_id))
    return key if key not in taken else f"token_id:{token_id}"


def _top(tokenizer: Tokenizer, position: PositionLogprobs) -> dict[str, float]:
    top: dict[str, float] = {}
    for token_id, lp in position.items():
        top[_candidate_key(tokenizer, token_id, lp.decoded_token or "", top)] = _clamped(lp.logprob)
    return top


def completion_logprobs(
    tokenizer: Tokenizer,
    positions: Sequence[PositionLogprobs | None],
    token_ids: Sequence[int],
    offsets: TextOffsets,
) -> CompletionLogprobs:
    """The legacy logprobs columns of ``token_ids``, whose logprobs are ``positions`` (a
    position of None, the first of a prompt, has a ``null`` logprob and top)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        if position is None:
            tokens.append(tokenizer.token_text(token_id))
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        own = position.get(token_id) or next(iter(position.values()))
        tokens.append(own.decoded_token or "")
        token_logprobs.append(_clamped(own.logprob))
        top_logprobs.append(_top(tokenizer, position))
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets.of(token_ids[: len(tokens)]),
    )


def _prompt_entry(lp: Logprob) -> PromptLogprob:
    return PromptLogprob(logprob=_clamped(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)


def prompt_logprobs(positions: Sequence[PositionLogprobs | None]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of a request: per position, the candidates by token id."""
    return [
        None
        if position is None
        else {str(token_id): _prompt_entry(lp) for token_id, lp in position.items()}
        for position in positions
    ]


def chat_logprobs(
    positions: list[PositionLogprobs], top: int, tokenizer: Tokenizer
) -> ChatLogprobs:
    """Each token's text and its own bytes (a token holding part of a character has those
    bytes, where its text shows U+FFFD), with its ``top`` most likely candidates."""
    content = []
    for position in positions:
        sampled_id, sampled = next(iter(position.items()))
        ranked = sorted(
            (item for item in position.items() if item[1].rank is not None and item[1].rank <= top),
            key=lambda item: item[1].rank or 0,
        )
        content.append(
            TokenLogprob(
                token=sampled.decoded_token or "",
                logprob=_clamped(sampled.logprob),
                bytes=list(tokenizer.token_bytes(sampled_id)),
                top_logprobs=[
                    TopLogprob(
                        token=lp.decoded_token or "",
                        logprob=_clamped(lp.logprob),
                        bytes=list(tokenizer.token_bytes(token_id)),
                    )
                    for token_id, lp in ranked
                ],
            )
        )
    return ChatLogprobs(content=content)
