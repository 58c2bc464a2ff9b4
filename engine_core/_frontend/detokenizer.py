"""Detokenization: the incremental text of one completion, with stop strings, and the decoded
candidate tokens of logprobs.

One :meth:`Detokenizer.update` per step decodes the new tokens (one decoder step each, never a
re-decode of the whole text) and feeds the new text to the request's stop-string automaton, so
matching costs the same per character whether a request has one stop string or many.
:meth:`Detokenizer.take` hands out the text that became final since the previous call, holding
back the last ``max(len(stop)) - 1`` characters while the completion runs so a partially
generated stop string never leaks. :meth:`Detokenizer.finish` adds what an unfinished UTF-8
character decodes to at the end, so the final text is the tokenizer's own decode of the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core._core.tokenizer import IncrementalDecoder, Tokenizer, output_decoder
from engine_core._frontend.stop_strings import StopMatcher, stop_matcher
from engine_core.abc import TokenLogprobs
from engine_core.outputs import Logprob, PositionLogprobs
from engine_core.sampling_params import SamplingParams

__all__ = ["Detokenizer", "LogprobsDecoder"]


class Detokenizer:
    """The text of one completion, built token by token.

    ``num_tokens`` counts the output tokens accepted so far; after :meth:`update` returns a stop
    string, the tokens of that call beyond the one completing it are not counted (they are
    dropped from the completion). ``stop_string`` is the stop string that ended it, if any.
    """

    __slots__ = (
        "_decoder",
        "_stops",
        "_matcher",
        "_node",
        "_include_stop",
        "_min_tokens",
        "_hold",
        "_overlap",
        "_buf",
        "_sent",
        "num_tokens",
        "stop_string",
    )

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._decoder: IncrementalDecoder | None = (
            output_decoder(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            if tokenizer is not None and params.detokenize
            else None
        )
        self._stops = tuple(params.stop_strings)
        # Mutation testing: building a matcher without stop strings is equivalent (a slower
        # path to the same text).
        self._matcher: StopMatcher | None = (
            stop_matcher(self._stops) if self._stops else None  # pragma: no mutate
        )
        self._node = 0
        """The stop-string automaton's state after the text decoded so far (a stop string
        begins in the completion, never in the prompt)."""
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        longest = max(map(len, self._stops), default=1)
        self._overlap = longest - 1
        self._hold = 0 if self._include_stop else self._overlap
        # _buf holds the text not yet taken (from _sent on) plus up to _overlap characters
        # before it, which a stop string completed by the next token may start in.
        self._buf = ""
        self._sent = 0
        self.num_tokens = 0
        self.stop_string: str | None = None

    @property
    def decodes(self) -> bool:
        """Whether text is produced at all (a tokenizer is there and ``detokenize`` is on)."""
        return self._decoder is not None

    def update(self, token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Decode one step's tokens; return the stop string that ends the completion, if any.

        ``stop_terminated``: the engine ended the completion on the last of ``token_ids`` (EOS
        or a stop token id); that token's text is then left out unless
        ``include_stop_str_in_output``.
        """
        decoder = self._decoder
        count = len(token_ids)
        if decoder is None:
            self.num_tokens += count
            return None
        if stop_terminated and not self._include_stop:
            count -= 1
        if self._matcher is not None:
            return self._update_with_stops(decoder, self._matcher, token_ids, count)
        step = decoder.step
        # Mutation testing: the one-token case is a shortcut (`and False` is equivalent).
        text = (
            step(token_ids[0])
            if count == 1  # pragma: no mutate
            else "".join([step(t) for t in token_ids[:count]])
        )
        if text:
            self._buf += text
        self.num_tokens += len(token_ids)
        return None

    def _update_with_stops(
        self,
        decoder: IncrementalDecoder,
        matcher: StopMatcher,
        token_ids: Sequence[int],
        count: int,
    ) -> str | None:
        step = decoder.step
        buf = self._buf
        num_tokens = self.num_tokens
        for i in range(count):
            text = step(token_ids[i])
            num_tokens += 1
            if not text:
                continue
            start = len(buf)
            buf += text
            if num_tokens <= self._min_tokens:
                # Text of the first min_tokens tokens cannot end a stop string (it may begin
                # one that ends later, as in vLLM).
                self._node = matcher.advance(self._node, text)
                continue
            if self._scan(matcher, buf, text, start):
                self.num_tokens = num_tokens
                return self.stop_string
        self._buf = buf
        self.num_tokens = num_tokens + len(token_ids) - count
        return None

    def _scan(self, matcher: StopMatcher, buf: str, text: str, start: int) -> bool:
        """Feed ``text`` (at ``start`` in ``buf``) to the automaton. On a stop string, ``_buf``
        becomes ``buf`` truncated before or after it and True is returned."""
        self._node, index, end = matcher.scan(self._node, text, start)
        if index < 0:
            return False
        stop = matcher.stops[index]
        self._buf = buf[:end] if self._include_stop else buf[: end - len(stop)]
        self.stop_string = stop
        return True

    def finish(self) -> None:
        """The completion ended without a stop string: add what the decoder still holds (an
        unfinished UTF-8 character decodes to U+FFFD, as the tokenizer's ``decode`` does)."""
        if self._decoder is None or self.stop_string is not None:
            return
        tail = self._decoder.flush()
        if tail:
            self._buf += tail

    def take(self, finished: bool) -> str:
        """The text that became final since the previous call.

        While not ``finished``, the last ``max(len(stop)) - 1`` characters are held back when
        stop strings are excluded from the output.
        """
        buf = self._buf
        if not self._overlap:
            # No stop strings: nothing is held back or kept for overlap.
            if not buf:
                return ""
            self._buf = ""
            return buf
        end = len(buf)
        if self._hold and not finished:
            end -= self._hold
        sent = self._sent
        # Mutation testing: `end < sent` is equivalent (an empty take trims nothing more), and
        # so are a shortcut that is never taken and trimming from 1 character on instead of 0.
        if end <= sent:  # pragma: no mutate
            return ""
        text = buf if sent == 0 and end == len(buf) else buf[sent:end]  # pragma: no mutate
        keep_from = end - self._overlap
        if keep_from <= 0:  # pragma: no mutate
            self._sent = end
        else:
            self._buf = buf[keep_from:]
            self._sent = end - keep_from
        return text


class LogprobsDecoder:
    """Turns the engine's :class:`~engine_core.abc.TokenLogprobs` into ``{token_id: Logprob}``,
    decoding each candidate token once: the text it adds after a word (a word-start piece keeps
    its leading space, special tokens show)."""

    __slots__ = ("_tokenizer", "_texts")

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str | None:
        """The text of one token (None without a tokenizer)."""
        text = self._texts.get(token_id)
        if text is None and self._tokenizer is not None:
            text = self._texts[token_id] = self._tokenizer.token_text(token_id)
        return text

    def position(self, entry: TokenLogprobs, decode: bool) -> PositionLogprobs:
        """One position, the sampled (or prompt) token first; ``decode=False`` leaves
        ``decoded_token`` None."""
        triples = zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True)
        if decode and self._tokenizer is not None:
            text = self.token_text
            return {t: Logprob(lp, rank, text(t)) for t, lp, rank in triples}
        return {t: Logprob(lp, rank) for t, lp, rank in triples}
