"""The mock's token rule: which token it samples after a request's tokens.

Greedy counts up from the last token; random sampling hashes (seed, token history); a scripted
reply or a copied prompt span replaces the rule's token; then the grammar bitmask row, the
logit bias and the masks (stop ids below ``min_tokens``, banned ids) move it. The same rule
decodes, verifies drafts position by position and tells the drafter what it would produce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine_core_mock._sampling import bitmask_rows, is_allowed, next_allowed, weighted_allowed
from engine_core_mock._state import RequestState
from engine_core_mock._token_classes import QUOTE, TokenClasses, token_classes

__all__ = ["TokenRule", "grammar_rows"]


def grammar_rows(
    batch: list[RequestState], bitmask: Any, vocab_size: int
) -> dict[int, list[list[int]]]:
    """A step's grammar bitmask as batch index -> rows. Each constrained request that samples
    this step (not on a partial prefill chunk) has one row per verified position (``1 + s``
    with ``s`` drafts), in batch order."""
    counts = [
        (i, 1 + len(r.drafts))
        for i, r in enumerate(batch)
        if r.constrained and (r.drafts or r.num_computed_tokens == len(r.tokens))
    ]
    expected = sum(n for _, n in counts)
    if len(bitmask) != expected:
        raise RuntimeError(
            f"grammar bitmask has {len(bitmask)} rows but the batch has {expected} "
            "constrained positions to sample (one row per verified position)"
        )
    owners = [batch[i].req_id for i, n in counts for _ in range(n)]
    rows = bitmask_rows(bitmask, vocab_size, owners)
    found: dict[int, list[list[int]]] = {}
    at = 0
    for i, n in counts:
        found[i] = rows[at : at + n]
        at += n
    return found


class TokenRule:
    """The mock's sampling rule over a vocabulary of ``vocab_size`` tokens."""

    __slots__ = ("vocab_size", "tokenizer_name", "_classes")

    def __init__(self, vocab_size: int, tokenizer_name: str) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_name = tokenizer_name
        self._classes: TokenClasses | None = None

    def next_token(self, state: RequestState, words: list[int] | None) -> tuple[int, int]:
        """The token the mock samples after ``state.tokens`` (``words``: the grammar's bitmask
        row), and the centre of the synthetic distribution there."""
        centre = state.tokens[-1] + 1 + state.lora_offset
        if centre >= self.vocab_size:
            centre %= self.vocab_size
        reply = state.reply_token()
        if reply is not None:
            centre = reply
        return self.choose(state, centre, words, reply), centre

    def choose(
        self, state: RequestState, centre: int, words: list[int] | None, reply: int | None
    ) -> int:
        """The token of a request off the hot path: the scripted ``reply``'s token, else the
        rule's token (``centre`` when greedy, else the random one) or, under a grammar
        (``words``), the grammar's choice; then the logit bias; then the first token at or
        after it that nothing masks."""
        vocab_size = self.vocab_size
        masked = state.masked()
        token: int | None
        if reply is not None:
            token = reply
        elif words is None:
            token = centre if state.greedy else state.random_token(vocab_size)
        else:
            token = self._grammar_choice(state, centre, words, masked)
        if token is None:
            token = centre
        if state.logit_bias is not None:
            token = state.logit_bias.choose(token, centre, vocab_size, state.greedy, masked, words)
        if masked is not None or words is not None:
            allowed = next_allowed(token, vocab_size, masked, words)
            if allowed is None:
                # Nothing is allowed: a grammar that admits only stop ids before min_tokens, or
                # bans covering what the grammar admits. A model's sampler would draw from all
                # -inf logits; the mock takes a token the grammar refuses (so the grammar check
                # ends that request with an error) and, past that, lets bans give way.
                allowed = next_allowed(token, vocab_size, masked, None)
                return token if allowed is None else allowed
            token = allowed
        return token

    def _grammar_choice(
        self, state: RequestState, centre: int, words: list[int], masked: frozenset[int] | None
    ) -> int | None:
        """The token of a request under a grammar (None: none is allowed but masked ones).

        A model ends what it writes; the mock closes a structure as soon as the grammar lets
        it: EOS when allowed, else a closing ``"``, ``]`` or ``}`` (never right after its
        opener: a string gets one character, an array one element, an object one member),
        else the rule's token. Whitespace, which JSON allows between any two tokens, is taken
        only where nothing else is. Greedy takes the first of these that the grammar allows
        (the rule's token: the first allowed at or after ``centre``); sampling draws with
        closing tokens far heavier than the others and whitespace far lighter."""
        classes = self.token_classes()
        closing, held = self._closing(state, classes, words, masked)
        if state.greedy:
            if closing:
                return closing[0]
            excluded = classes.whitespace | held
            return next_allowed(
                centre, self.vocab_size, excluded | masked if masked else excluded, words
            )
        light = classes.whitespace | held
        return weighted_allowed(state.random_draw(), self.vocab_size, masked, words, closing, light)

    @staticmethod
    def _closing(
        state: RequestState,
        classes: TokenClasses,
        words: list[int],
        masked: frozenset[int] | None,
    ) -> tuple[list[int], frozenset[int]]:
        """(the allowed tokens that would close something now, in order of preference: EOS
        first; the closing tokens that must not, right after their opener)."""
        tokens = state.tokens
        last = len(tokens) - 1  # the last token that is not whitespace
        while last >= state.num_prompt_tokens and tokens[last] in classes.whitespace:
            last -= 1
        previous = tokens[last] if last >= state.num_prompt_tokens else None
        closing = [t for t in state.eos_ids if is_allowed(t, masked, words)]
        # Where a character no JSON structure has is allowed, the output is inside a string
        # (or free text): brackets and braces are characters there, only a quote closes.
        in_text = any(is_allowed(t, masked, words) for t in classes.text_only)
        held: frozenset[int] = frozenset()
        for index, (closers, openers) in enumerate(classes.closing):
            if in_text and index != QUOTE:
                continue
            if previous is not None and previous in openers:
                held |= closers
            else:
                closing += [t for t in sorted(closers) if is_allowed(t, masked, words)]
        return closing, held

    def token_classes(self) -> TokenClasses:
        """The tokenizer's whitespace and closing tokens (read once, at the first need)."""
        if self._classes is None:
            self._classes = token_classes(self.tokenizer_name)
        return self._classes

    def verify(
        self, state: RequestState, drafts: list[int], rows: list[list[int]] | None
    ) -> tuple[list[int], list[int]]:
        """Exact verification: sample each of the ``1 + len(drafts)`` positions as decoding
        would (``rows``: the grammar row of each), appending to ``state.tokens``, and stop at
        the first sample that differs from its draft. Returns the tokens (the accepted drafts,
        then the token sampled where they stopped) and each one's distribution centre."""
        tokens = state.tokens
        out: list[int] = []
        centres: list[int] = []
        for j in range(len(drafts) + 1):
            if state.plain:
                token = centre = (tokens[-1] + 1) % self.vocab_size
            else:
                token, centre = self.next_token(state, rows[j] if rows is not None else None)
            tokens.append(token)
            out.append(token)
            centres.append(centre)
            if j == len(drafts) or token != drafts[j]:
                break
        return out, centres

    def after(self, state: RequestState) -> Callable[[list[int]], int]:
        """``next_token(extra)``: the token the rule gives after ``state.tokens`` followed by
        ``extra`` (without a grammar row), which the drafter guesses."""
        vocab_size = self.vocab_size
        tokens = state.tokens
        if state.plain:
            last = tokens[-1]
            return lambda extra: ((extra[-1] if extra else last) + 1) % vocab_size

        def next_token(extra: list[int]) -> int:
            num = len(tokens)
            tokens.extend(extra)
            state.num_tentative = len(extra)
            try:
                return self.next_token(state, None)[0]
            finally:
                del tokens[num:]
                state.num_tentative = 0

        return next_token
