"""The layer kinds the mock pretends (``layer_types``) and the KV-cache groups it is given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_core.abc import ChunkedLocalSpec, FullAttentionSpec, LayerSpec, SlidingWindowSpec
from engine_core_mock._blocks import GroupKind

if TYPE_CHECKING:
    from engine_core_mock._options import ModelGeometry

__all__ = ["LAYER_TYPES", "group_kinds", "layer_spec"]

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Hugging Face's names of the layer kinds."""


def layer_spec(
    kind: str,
    num_kv_heads: int,
    head_size: int,
    dtype_bytes: int,
    window: int | None,
    chunk: int | None,
) -> LayerSpec:
    """The ``engine_core.abc`` spec of one layer of kind ``kind``."""
    if kind == "sliding_attention":
        assert window is not None
        return SlidingWindowSpec(
            num_kv_heads=num_kv_heads, head_size=head_size, dtype_bytes=dtype_bytes, window=window
        )
    if kind == "chunked_attention":
        assert chunk is not None
        return ChunkedLocalSpec(
            num_kv_heads=num_kv_heads, head_size=head_size, dtype_bytes=dtype_bytes, chunk=chunk
        )
    return FullAttentionSpec(
        num_kv_heads=num_kv_heads, head_size=head_size, dtype_bytes=dtype_bytes
    )


def _kind_of(geometry: ModelGeometry, layer: int) -> GroupKind:
    assert geometry.layer_types is not None
    kind = geometry.layer_types[layer]
    if kind == "sliding_attention":
        return GroupKind(kind, geometry.sliding_window)
    if kind == "chunked_attention":
        return GroupKind(kind, geometry.chunk_size)
    return GroupKind()


def group_kinds(
    geometry: ModelGeometry, kv_groups: Sequence[Sequence[int]] | None
) -> list[GroupKind]:
    """What each KV-cache group's layers read. ``ValueError`` unless every layer is in
    exactly one group and the layers of a group are of one kind. Without ``kv_groups`` every
    layer reads one table whole (a window layer masks what it does not see)."""
    if kv_groups is None:
        return [GroupKind()]
    if geometry.layer_types is None:
        raise ValueError("kv_groups given to a mock without layer_types")
    num_layers = geometry.num_layers
    seen = [layer for group in kv_groups for layer in group]
    if sorted(seen) != list(range(num_layers)) or any(not group for group in kv_groups):
        raise ValueError(
            f"kv_groups must hold each of the {num_layers} layers once, got {kv_groups!r}"
        )
    kinds = []
    for g, group in enumerate(kv_groups):
        kind = _kind_of(geometry, group[0])
        for layer in group:
            if _kind_of(geometry, layer) != kind:
                raise ValueError(
                    f"kv_groups[{g}] mixes layer {group[0]} ({kind.kind}) with layer {layer} "
                    f"({geometry.layer_types[layer]})"
                )
        kinds.append(kind)
    return kinds
