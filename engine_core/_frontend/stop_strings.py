"""Stop-string matching in time linear in the generated text, however many stop strings a
request has.

An Aho–Corasick automaton over the stop strings is fed the completion's characters once each; a
node knows every stop string that ends at it (its own and, through suffix links, the shorter ones
that end the same way). The automaton is built once per distinct tuple of stop strings and shared
by every request that uses that tuple; a request only keeps its current node.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

__all__ = ["StopMatcher", "stop_matcher"]


class StopMatcher:
    """The automaton of one tuple of stop strings. :meth:`scan` finds the stop string that
    completes earliest in new text (ties: the one listed first)."""

    __slots__ = ("stops", "_goto", "_fail", "_ends")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._goto: list[dict[str, int]] = [{}]
        ends: list[list[int]] = [[]]
        for index, stop in enumerate(stops):
            node = 0
            for char in stop:
                nxt = self._goto[node].get(char)
                if nxt is None:
                    nxt = self._goto[node][char] = len(self._goto)
                    self._goto.append({})
                    ends.append([])
                node = nxt
            ends[node].append(index)
        self._fail = [0] * len(self._goto)
        # Breadth first, so a node's suffix link is complete before its children need it.
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                queue.append(child)
                link = self._fail[node]
                while link and char not in self._goto[link]:
                    link = self._fail[link]
                self._fail[child] = self._goto[link].get(char, 0)
                ends[child] = ends[child] + ends[self._fail[child]]
        # Each node's stop strings, listed first first (they all end at the node).
        self._ends: list[tuple[int, ...]] = [tuple(sorted(set(found))) for found in ends]

    def scan(self, node: int, text: str, offset: int) -> tuple[int, int, int]:
        """Feed ``text`` from automaton state ``node``; ``offset`` is the position of ``text``
        in the completion. A stop string counts when it ends in ``text``, wherever it starts.

        Returns ``(node, stop_index, end)``: the state after the text, and the earliest
        completed stop string with the position just past it, or ``stop_index == -1`` (the whole
        text fed) when none completed.
        """
        goto, fail, ends = self._goto, self._fail, self._ends
        for position, char in enumerate(text, offset):
            nxt = goto[node].get(char)
            while nxt is None and node:
                node = fail[node]
                nxt = goto[node].get(char)
            node = nxt or 0
            found = ends[node]
            if found:
                return node, found[0], position + 1
        # Mutation testing: the end of "no stop string" is never read (nor is the index beyond
        # being negative), so mutants of this line are equivalent.
        return node, -1, 0  # pragma: no mutate

    def advance(self, node: int, text: str) -> int:
        """The state after feeding ``text`` from ``node``, ignoring the stop strings it
        completes (text that cannot end a stop string, but may begin one)."""
        goto, fail = self._goto, self._fail
        for char in text:
            nxt = goto[node].get(char)
            while nxt is None and node:
                node = fail[node]
                nxt = goto[node].get(char)
            node = nxt or 0
        return node


@lru_cache(maxsize=256)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The shared automaton of ``stops``."""
    return StopMatcher(stops)
