"""``CumulativeOutputs``: CUMULATIVE outputs built from deltas, by whoever reads them.

The output processor produces every streamed output as a delta (the text, tokens and logprobs
a step added), whatever the request's output kind: its per-step work is then proportional to the
new tokens, not to everything generated so far. A CUMULATIVE request's reader folds the deltas
into a ``CumulativeOutputs`` and gets, at each read, the whole of each completion that changed:
the copying a cumulative output needs is done once per read, by the reader (the consumer's task,
through its :class:`~engine_core._frontend.collector.RequestOutputCollector`), never by the
output handler that all requests share.
"""

from __future__ import annotations

from engine_core.outputs import CompletionOutput, RequestOutput

__all__ = ["CumulativeOutputs"]


class CumulativeOutputs:
    """Everything the completions of one request produced so far, grown by delta outputs."""

    __slots__ = ("_completions", "copied")

    def __init__(self) -> None:
        self._completions: dict[int, CompletionOutput] = {}
        """Unfinished completions by index: their text, tokens and logprobs so far (lists owned
        here, never handed out)."""
        self.copied = 0
        """Token ids and logprobs positions the last :meth:`add` copied."""

    def add(self, output: RequestOutput) -> RequestOutput:
        """Fold in ``output``, whose completions are deltas the caller owns, and turn it into
        the cumulative output, in place: each of its completions becomes all that completion
        produced so far, in lists of its own (a finished completion's lists are handed over,
        no longer kept here). Costs the new tokens plus one copy of what the named completions
        hold (counted in :attr:`copied`)."""
        completions = self._completions
        copied = 0
        for delta in output.outputs:
            index = delta.index
            total = completions.get(index)
            if total is None:
                # The completion's first output: the delta is all of it.
                if delta.finish_reason is None:
                    completions[index] = CompletionOutput(
                        index,
                        delta.text,
                        list(delta.token_ids),
                        None,
                        None if delta.logprobs is None else list(delta.logprobs),
                    )
                continue
            if delta.text:
                total.text += delta.text
            total.token_ids.extend(delta.token_ids)
            logprobs = total.logprobs
            if delta.logprobs is not None:
                if logprobs is None:
                    logprobs = total.logprobs = list(delta.logprobs)
                else:
                    logprobs.extend(delta.logprobs)
            delta.text = total.text
            if delta.finish_reason is not None:
                # Nothing follows a finished completion: its lists go to the reader as they are.
                del completions[index]
                delta.token_ids = total.token_ids
            else:
                delta.token_ids = total.token_ids.copy()
                copied += len(delta.token_ids)
                if logprobs is not None:
                    logprobs = logprobs.copy()
                    copied += len(logprobs)
            delta.logprobs = logprobs
        self.copied = copied
        return output
