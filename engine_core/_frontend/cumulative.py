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

    __slots__ = ("_completions",)

    def __init__(self) -> None:
        self._completions: dict[int, CompletionOutput] = {}
        """Unfinished completions by index: their text, tokens and logprobs so far (lists owned
        here, never handed out)."""

    def add(self, output: RequestOutput) -> RequestOutput:
        """Fold in ``output``, whose completions are deltas, and turn it into the cumulative
        output: each of its completions becomes all that completion produced so far, in lists
        of its own (a finished completion's lists are handed over, no longer kept here).
        Costs the new tokens plus one copy of what the named completions hold."""
        completions = self._completions
        cumulative: list[CompletionOutput] = []
        for delta in output.outputs:
            index = delta.index
            total = completions.get(index)
            if total is None:
                logprobs = None if delta.logprobs is None else list(delta.logprobs)
                if delta.finish_reason is not None:  # its first output is its last
                    cumulative.append(
                        CompletionOutput(
                            index,
                            delta.text,
                            list(delta.token_ids),
                            delta.cumulative_logprob,
                            logprobs,
                            delta.finish_reason,
                            delta.stop_reason,
                        )
                    )
                    continue
                total = CompletionOutput(index, delta.text, list(delta.token_ids), None, logprobs)
                completions[index] = total
            else:
                if delta.text:
                    total.text += delta.text
                total.token_ids.extend(delta.token_ids)
                if delta.logprobs is not None:
                    if total.logprobs is None:
                        total.logprobs = list(delta.logprobs)
                    else:
                        total.logprobs.extend(delta.logprobs)
            logprobs = total.logprobs
            if delta.finish_reason is not None:
                # Nothing follows a finished completion: its lists go to the reader as they are.
                del completions[index]
                token_ids = total.token_ids
            else:
                token_ids = total.token_ids.copy()
                if logprobs is not None:
                    logprobs = logprobs.copy()
            cumulative.append(
                CompletionOutput(
                    index,
                    total.text,
                    token_ids,
                    delta.cumulative_logprob,
                    logprobs,
                    delta.finish_reason,
                    delta.stop_reason,
                )
            )
        output.outputs = cumulative
        return output
