"""Which live requests hold each KV block, and which token prefix each block's KV holds.

A real KV cache would silently attend to the wrong keys if the scheduler handed out a block that
another request still writes, or a "cached" block holding a different prefix. The mock keeps a
fingerprint of the prefix each full block was written for (and of the KV-cache group whose
layers wrote it), so both mistakes raise instead.

With a layout of several KV-cache groups (``layer_types``), each request has one table per
group. A window (chunked-local) group's attention reads only the blocks from the first one its
queries see (:meth:`GroupKind.first_live_block`); the mock lets go of the blocks before it on
its own, as a real kernel would stop reading them, so the scheduler may hand them to another
request, and it checks that every block its queries do read is real, held and holds the KV it
should: a released block read by a window layer is an error the tests see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_core_mock._state import RequestState

__all__ = ["BlockLedger", "GroupKind"]

_UNWRITTEN = -1
"""Content of a block that is being written (or never was)."""
_DISCARDED = -2
"""Content of a block whose KV was dropped by ``sleep()``."""
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class GroupKind:
    """What the layers of one KV-cache group read: every earlier key (``span`` None), a
    sliding window of ``span`` keys, or the keys of the current chunk of ``span`` tokens."""

    kind: str = "full_attention"
    span: int | None = None

    def first_live_block(self, num_computed: int, block_size: int) -> int:
        """The first block that queries from position ``num_computed`` on read."""
        span = self.span
        if span is None:
            return 0
        if self.kind == "chunked_attention":
            return num_computed // span * span // block_size
        start = num_computed - span + 1
        return start // block_size if start > 0 else 0


_FULL = GroupKind()


class BlockLedger:
    """Reference counts and content fingerprints of the ``num_blocks`` KV blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        holders: Callable[[int], list[str]],
        groups: Sequence[GroupKind] = (_FULL,),
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._holders = holders
        self._refs = [0] * num_blocks
        self._contents = [_UNWRITTEN] * num_blocks
        self.groups = tuple(groups)
        self.num_groups = len(self.groups)
        self._salts = [(g * 0x9E3779B97F4A7C15) & _MASK for g in range(self.num_groups)]

    def tables(self, state: RequestState) -> list[list[int]]:
        """The request's block table per group (group 0's is ``state.block_ids``)."""
        tables = state.group_tables
        if tables is None:
            tables = state.group_tables = [state.block_ids] + [
                [] for _ in range(self.num_groups - 1)
            ]
            state.released = [0] * self.num_groups
        return tables

    def per_group(self, state: RequestState, block_ids: list[int | list[int]]) -> list[list[int]]:
        """One request's block ids as the scheduler sent them, per group."""
        if self.num_groups == 1:
            if any(not isinstance(b, int) for b in block_ids):
                raise RuntimeError(
                    f"request {state.req_id!r}: nested block ids for a one-group layout"
                )
            return [block_ids]  # type: ignore[list-item]
        if len(block_ids) != self.num_groups or any(not isinstance(b, list) for b in block_ids):
            raise RuntimeError(
                f"request {state.req_id!r}: block ids must be {self.num_groups} lists (one per "
                f"KV-cache group), got {block_ids!r}"
            )
        per_group: list[list[int]] = block_ids  # type: ignore[assignment]
        if len({len(ids) for ids in per_group}) != 1:
            raise RuntimeError(
                f"request {state.req_id!r}: the groups' new block ids differ in length "
                f"({[len(ids) for ids in per_group]})"
            )
        return per_group

    def append(
        self, state: RequestState, block_ids: list[int | list[int]], num_computed: int
    ) -> None:
        """Append ``block_ids`` (per group) to ``state``'s tables. Blocks entirely inside its
        first ``num_computed`` tokens (prefix-cache hits) must hold that prefix's KV; blocks
        still to be written must be held by no other live request; entries a window group
        reads must be real blocks."""
        tables = self.tables(state)
        per_group = self.per_group(state, block_ids)
        for g, ids in enumerate(per_group):
            self._append_group(state, g, tables[g], ids, num_computed)

    def _append_group(
        self, state: RequestState, g: int, table: list[int], ids: list[int], num_computed: int
    ) -> None:
        refs = self._refs
        contents = self._contents
        num_blocks = self.num_blocks
        block_size = self.block_size
        salt = self._salts[g]
        group = self.groups[g]
        first_live = group.first_live_block(num_computed, block_size) if group.span else 0
        released = state.released
        for block_id in ids:
            index = len(table)
            if block_id < 0 and index < first_live:
                table.append(block_id)  # a null entry the window never reads
                if released is not None and released[g] == index:
                    released[g] = index + 1
                continue
            if not (0 <= block_id < num_blocks):
                raise RuntimeError(
                    f"request {state.req_id!r}: block id {block_id} is outside the KV cache "
                    f"({num_blocks} blocks)"
                    + (
                        f"; group {g} ({group.kind}) reads position {index}"
                        if self.num_groups > 1 or group.span
                        else ""
                    )
                )
            if (index + 1) * block_size <= num_computed:
                content = contents[block_id]
                if content != state.block_fingerprint(index, block_size) ^ salt:
                    raise RuntimeError(self._describe_bad_hit(state, block_id, index, content, g))
            else:
                if refs[block_id]:
                    raise RuntimeError(
                        f"request {state.req_id!r}: block {block_id} (position {index}"
                        + (f", group {g}" if self.num_groups > 1 else "")
                        + f") is still held by live request(s) {self._holders(block_id)}"
                    )
                contents[block_id] = _UNWRITTEN
            refs[block_id] += 1
            table.append(block_id)

    def release_behind(self, state: RequestState, num_computed: int) -> None:
        """A step computes from position ``num_computed`` of ``state``: its window groups stop
        reading the blocks before their first live one, and the mock lets go of them."""
        tables = self.tables(state)
        released = state.released
        assert released is not None
        block_size = self.block_size
        refs = self._refs
        for g, group in enumerate(self.groups):
            if group.span is None:
                continue
            table = tables[g]
            first = group.first_live_block(num_computed, block_size)
            for index in range(released[g], min(first, len(table))):
                block_id = table[index]
                if block_id >= 0:
                    refs[block_id] -= 1
                table[index] = -1
            if first > released[g]:
                released[g] = first

    def check_reads(self, state: RequestState, num_computed: int, end: int) -> None:
        """Every block the window groups' queries for positions ``num_computed .. end`` read
        must be real and hold this request's KV (what a kernel would attend to)."""
        tables = self.tables(state)
        block_size = self.block_size
        contents = self._contents
        last = -(-end // block_size)
        for g, group in enumerate(self.groups):
            if group.span is None:
                continue
            table = tables[g]
            first = group.first_live_block(num_computed, block_size)
            salt = self._salts[g]
            for index in range(first, min(last, len(table))):
                block_id = table[index]
                if block_id < 0:
                    raise RuntimeError(
                        f"request {state.req_id!r}: its {group.kind} layers (group {g}) read "
                        f"position {index} of their table, which holds a released block"
                    )
                if (index + 1) * block_size <= num_computed and contents[block_id] != (
                    state.block_fingerprint(index, block_size) ^ salt
                ):
                    raise RuntimeError(
                        self._describe_bad_hit(state, block_id, index, contents[block_id], g)
                    )

    def record_written(self, state: RequestState, start: int, end: int) -> None:
        """The blocks of ``state`` that became full between token positions ``start`` and
        ``end`` now hold the KV of its prefix (in every group)."""
        block_size = self.block_size
        contents = self._contents
        tables = state.group_tables or [state.block_ids]
        salts = self._salts
        for index in range(start // block_size, end // block_size):
            fingerprint = state.block_fingerprint(index, block_size)
            for g, table in enumerate(tables):
                block_id = table[index]
                if block_id >= 0:
                    contents[block_id] = fingerprint ^ salts[g]

    def release(self, state: RequestState) -> None:
        """``state`` no longer holds its blocks (their KV stays, for prefix-cache hits)."""
        refs = self._refs
        for table in state.group_tables or [state.block_ids]:
            for block_id in table:
                if block_id >= 0:
                    refs[block_id] -= 1

    def discard_contents(self) -> None:
        """Forget every block's KV (no cached prefix may be used afterwards)."""
        self._contents = [_DISCARDED] * self.num_blocks

    def _describe_bad_hit(
        self, state: RequestState, block_id: int, index: int, content: int, group: int = 0
    ) -> str:
        where = (
            f"request {state.req_id!r}: block {block_id} (position {index}"
            + (f", group {group}" if self.num_groups > 1 else "")
            + ") is used as computed"
        )
        if content == _DISCARDED:
            return f"{where}, but its KV was discarded by sleep() (reset the prefix cache)"
        if content == _UNWRITTEN:
            return f"{where}, but no request has finished writing it"
        holders = self._holders(block_id)
        return (
            f"{where}, but it holds the KV of a different token prefix or group (held by {holders})"
        )

    # -- the host tier (engine_core_mock._kv_link) ------------------------------------------------

    def content(self, block_id: int) -> int:
        """The fingerprint of the KV block ``block_id`` holds (what a save copies out)."""
        return self._contents[block_id]

    def set_content(self, block_id: int, value: int | None) -> None:
        """A load wrote ``value`` into ``block_id`` (None: a failed load left it unwritten)."""
        self._contents[block_id] = _UNWRITTEN if value is None else value

    def hold(self, block_id: int) -> None:
        """A transfer reads or writes ``block_id``: no request may be handed it to write."""
        self._refs[block_id] += 1

    def unhold(self, block_id: int) -> None:
        self._refs[block_id] -= 1
