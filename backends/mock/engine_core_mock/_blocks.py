"""Which live requests hold each KV block, and which token prefix each block's KV holds.

A real KV cache would silently attend to the wrong keys if the scheduler handed out a block that
another request still writes, or a "cached" block holding a different prefix. The mock keeps a
fingerprint of the prefix each full block was written for, so both mistakes raise instead.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_core_mock._state import RequestState

__all__ = ["BlockLedger"]

_UNWRITTEN = -1
"""Content of a block that is being written (or never was)."""
_DISCARDED = -2
"""Content of a block whose KV was dropped by ``sleep()``."""


class BlockLedger:
    """Reference counts and content fingerprints of the ``num_blocks`` KV blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, holders: Callable[[int], list[str]]
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._holders = holders
        self._refs = [0] * num_blocks
        self._contents = [_UNWRITTEN] * num_blocks

    def append(self, state: RequestState, block_ids: list[int], num_computed: int) -> None:
        """Append ``block_ids`` to ``state``'s block table. Blocks entirely inside its first
        ``num_computed`` tokens (prefix-cache hits) must hold that prefix's KV; blocks still to
        be written must be held by no other live request."""
        refs = self._refs
        contents = self._contents
        num_blocks = self.num_blocks
        block_size = self.block_size
        table = state.block_ids
        for block_id in block_ids:
            index = len(table)
            if not (0 <= block_id < num_blocks):
                raise RuntimeError(
                    f"request {state.req_id!r}: block id {block_id} is outside the KV cache "
                    f"({num_blocks} blocks)"
                )
            if (index + 1) * block_size <= num_computed:
                content = contents[block_id]
                if content != state.block_fingerprint(index, block_size):
                    raise RuntimeError(self._describe_bad_hit(state, block_id, index, content))
            else:
                if refs[block_id]:
                    raise RuntimeError(
                        f"request {state.req_id!r}: block {block_id} (position {index}) is "
                        f"still held by live request(s) {self._holders(block_id)}"
                    )
                contents[block_id] = _UNWRITTEN
            refs[block_id] += 1
            table.append(block_id)

    def record_written(self, state: RequestState, start: int, end: int) -> None:
        """The blocks of ``state`` that became full between token positions ``start`` and
        ``end`` now hold the KV of its prefix."""
        block_size = self.block_size
        contents = self._contents
        table = state.block_ids
        for index in range(start // block_size, end // block_size):
            contents[table[index]] = state.block_fingerprint(index, block_size)

    def release(self, state: RequestState) -> None:
        """``state`` no longer holds its blocks (their KV stays, for prefix-cache hits)."""
        refs = self._refs
        for block_id in state.block_ids:
            refs[block_id] -= 1

    def discard_contents(self) -> None:
        """Forget every block's KV (no cached prefix may be used afterwards)."""
        self._contents = [_DISCARDED] * self.num_blocks

    def _describe_bad_hit(
        self, state: RequestState, block_id: int, index: int, content: int
    ) -> str:
        where = f"request {state.req_id!r}: block {block_id} (position {index}) is used as computed"
        if content == _DISCARDED:
            return f"{where}, but its KV was discarded by sleep() (reset the prefix cache)"
        if content == _UNWRITTEN:
            return f"{where}, but no request has finished writing it"
        holders = self._holders(block_id)
        return f"{where}, but it holds the KV of a different token prefix (held by {holders})"
