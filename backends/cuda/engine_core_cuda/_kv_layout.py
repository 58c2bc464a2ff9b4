"""Which KV-cache group each layer's keys and values live in, and how a request's block ids
arrive per group (no torch).

The engine core may split the layers into **KV-cache groups** (full attention, sliding window,
chunked local; see ``docs/cuda_kv_groups.md``): each group has a block table of its own per
request, and all groups share one pool of pages of the same byte size. A page of group ``g``
holds one block of ``block_size`` tokens for every layer of ``g``; groups are padded to the
size of the largest, so the cache is one tensor ``[slots, 2, num_blocks, block_size,
kv_heads, head_size]`` and layer ``groups[g][j]`` uses slot ``j``. Block id ``b`` is a page of
exactly one group at a time, so layers of different groups that share a slot never meet.

With one group of every layer (:meth:`KVLayout.one_group`, today's layout) the tensor is
``[layers, 2, ...]`` and every layer reads the one table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["KVLayout", "group_block_ids"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The layers of each KV-cache group, in the order of the scheduler's tables."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def one_group(cls, num_layers: int) -> KVLayout:
        return cls((tuple(range(num_layers)),))

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]], num_layers: int) -> KVLayout:
        """``groups[g]``: the layer indices of group ``g``. ``ValueError`` unless every layer
        ``0 .. num_layers - 1`` is in exactly one non-empty group."""
        layout = cls(tuple(tuple(group) for group in groups))
        if not layout.groups or any(not group for group in layout.groups):
            raise ValueError(f"kv_groups: every group needs a layer, got {list(groups)!r}")
        seen = [layer for group in layout.groups for layer in group]
        bad = [x for x in seen if not isinstance(x, int) or isinstance(x, bool)]
        if bad:
            raise TypeError(f"kv_groups: layer indices must be ints, got {bad[0]!r}")
        if sorted(seen) != list(range(num_layers)):
            missing = sorted(set(range(num_layers)) - set(seen))
            extra = sorted({x for x in seen if seen.count(x) > 1 or not 0 <= x < num_layers})
            raise ValueError(
                f"kv_groups must hold each of the {num_layers} layers once; missing "
                f"{missing or 'none'}, repeated or out of range {extra or 'none'}"
            )
        return layout

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Layers per page: the size of the largest group."""
        return max(len(group) for group in self.groups)

    def placement(self, num_layers: int) -> list[tuple[int, int]]:
        """Per layer, its ``(group, slot)``."""
        where = [(0, 0)] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group):
                where[layer] = (g, slot)
        return where


def group_block_ids(block_ids: Sequence[object] | None, num_groups: int) -> list[list[int]]:
    """One request's block ids per group, as the scheduler sends them: a list of ints (one
    group), or one list per group (``block_ids[g]``); None or empty: none in any group.
    ``RuntimeError`` when the shape does not fit ``num_groups`` or the groups' lists differ in
    length (a window group's table keeps a null id per released block, so positions stay
    aligned across groups)."""
    if not block_ids:
        return [[] for _ in range(num_groups)]
    if all(isinstance(b, int) for b in block_ids):
        if num_groups != 1:
            raise RuntimeError(f"one block table sent for a layout of {num_groups} KV-cache groups")
        return [list(block_ids)]  # type: ignore[arg-type]
    per_group = [list(ids) for ids in block_ids]  # type: ignore[call-overload]
    if len(per_group) != num_groups:
        raise RuntimeError(
            f"{len(per_group)} block tables sent for a layout of {num_groups} KV-cache groups"
        )
    lengths = {len(ids) for ids in per_group}
    if len(lengths) != 1:
        raise RuntimeError(
            f"the groups' block tables grow by different lengths {sorted(lengths)}: every group "
            "needs an entry (a null id when released) per block of the request"
        )
    return per_group
