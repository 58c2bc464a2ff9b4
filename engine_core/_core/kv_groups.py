"""KV-cache groups: how the layers of a model share one pool of pages (pure logic).

A backend describes its layers (``engine_core.abc``: one :class:`~engine_core.abc.KVCacheSpec`
for a model whose layers are all full attention, or one layer spec per layer). Layers with
equal specs form a type; every type is cut into groups of ``size`` layers, ``size`` being the
smallest type's layer count (the last group of a type may be short: the backend pads it), so
every group's page (one block of ``block_size`` tokens for every layer of the group) has the
same byte size and one pool of pages serves all groups. A request holds one block table per
group; a window (chunked-local) group needs only the blocks its next queries can see, and the
blocks behind them are released while the request runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_core.abc import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LayerSpec,
    SlidingWindowSpec,
)

__all__ = ["FULL", "KVGroup", "KVLayout", "plan_kv_layout"]

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV-cache group: its kind, its window (chunk) size and its layers."""

    kind: str
    span: int | None
    """The window (sliding), the chunk (chunked local), None (full attention)."""
    layers: tuple[int, ...]

    def first_live_block(self, num_computed: int, block_size: int) -> int:
        """The first block of the table that the queries from position ``num_computed`` on
        can see; the blocks before it may be released."""
        span = self.span
        if span is None:
            return 0
        if self.kind == CHUNKED:
            return num_computed // span * span // block_size
        start = num_computed - span + 1
        return start // block_size if start > 0 else 0

    def max_live_blocks(self, num_tokens: int, tokens_per_step: int, block_size: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once in this group when
        a step computes at most ``tokens_per_step`` of them."""
        total = -(-num_tokens // block_size)
        span = self.span
        if span is None:
            return total
        return min(total, -(-(span - 1 + tokens_per_step) // block_size) + 1)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups of a model's layers and the byte size of one page (block) of the pool."""

    groups: tuple[KVGroup, ...]
    page_size_bytes: int
    per_layer: bool
    """Whether the backend gave per-layer specs (it is then told the groups at startup)."""

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_one_full_group(self) -> bool:
        """One group of full-attention layers: the plain block table of old."""
        return len(self.groups) == 1 and self.groups[0].span is None

    @property
    def kv_groups(self) -> list[list[int]]:
        """The layer indices of each group (what ``initialize_kv_cache`` is told)."""
        return [list(group.layers) for group in self.groups]

    def blocks_needed(self, num_tokens: int, tokens_per_step: int, block_size: int) -> int:
        """Blocks of the pool one request of ``num_tokens`` tokens needs at its peak."""
        return sum(g.max_live_blocks(num_tokens, tokens_per_step, block_size) for g in self.groups)

    def max_tokens_in(self, num_blocks: int, tokens_per_step: int, block_size: int) -> int | None:
        """The longest request ``num_blocks`` blocks hold (None: any length, when no group
        keeps every block of a request)."""
        if (
            not any(g.span is None for g in self.groups)
            and self.blocks_needed(1 << 62, tokens_per_step, block_size) <= num_blocks
        ):
            return None
        lo, hi = 0, num_blocks * block_size
        while lo < hi:  # the need grows with the length: the largest length that fits
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid, tokens_per_step, block_size) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            what = g.kind if g.span is None else f"{g.kind}({g.span})"
            parts.append(f"{what} x{len(g.layers)}")
        return ", ".join(parts)


def _spec_key(spec: LayerSpec) -> tuple[object, ...]:
    span = spec.window if isinstance(spec, SlidingWindowSpec) else getattr(spec, "chunk", None)
    return (spec.kind, span, spec.num_kv_heads, spec.head_size, spec.dtype_bytes)


def _check_layer(index: int, spec: object) -> LayerSpec:
    if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec):
        raise ValueError(
            f"kv_cache_spec(): layer {index} is {spec!r}, not a FullAttentionSpec, "
            "SlidingWindowSpec or ChunkedLocalSpec"
        )
    fields = ["num_kv_heads", "head_size", "dtype_bytes"]
    if isinstance(spec, SlidingWindowSpec):
        fields.append("window")
    elif isinstance(spec, ChunkedLocalSpec):
        fields.append("chunk")
    for field in fields:
        value = getattr(spec, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"kv_cache_spec(): layer {index} ({spec.kind}) has {field}={value!r}; "
                "it must be an int > 0"
            )
    return spec


def plan_kv_layout(spec: KVCacheSpec | Sequence[LayerSpec], block_size: int) -> KVLayout:
    """Group a backend's layers. ``ValueError`` naming the layer and the field for specs that
    are inconsistent: no layers, a size or window that is not a positive int, or layers whose
    pages differ in bytes (which one pool of equal pages cannot hold)."""
    if isinstance(spec, KVCacheSpec):
        if spec.num_layers <= 0:
            raise ValueError(f"kv_cache_spec(): num_layers={spec.num_layers}; it must be > 0")
        group = KVGroup(FULL, None, tuple(range(spec.num_layers)))
        return KVLayout((group,), spec.bytes_per_block(block_size), per_layer=False)
    specs = [_check_layer(i, s) for i, s in enumerate(spec)]
    if not specs:
        raise ValueError("kv_cache_spec() returned no layers")
    page = specs[0].page_size_bytes(block_size)
    for i, s in enumerate(specs):
        if s.page_size_bytes(block_size) != page:
            first = specs[0]
            raise ValueError(
                f"kv_cache_spec(): layer {i} has num_kv_heads={s.num_kv_heads}, "
                f"head_size={s.head_size}, dtype_bytes={s.dtype_bytes} "
                f"({s.page_size_bytes(block_size)} bytes per block), layer 0 has "
                f"num_kv_heads={first.num_kv_heads}, head_size={first.head_size}, "
                f"dtype_bytes={first.dtype_bytes} ({page} bytes): pages of different sizes "
                "cannot share one KV-cache pool"
            )
    types: dict[tuple[object, ...], list[int]] = {}
    for i, s in enumerate(specs):
        types.setdefault(_spec_key(s), []).append(i)
    # Full attention first: group 0 is a full group whenever the model has one (a draft model
    # reads group 0's table).
    ordered = sorted(types.items(), key=lambda item: item[0][1] is not None)
    size = min(len(layers) for _, layers in ordered)
    groups = []
    for key, layers in ordered:
        kind, span = key[0], key[1]
        assert isinstance(kind, str) and (span is None or isinstance(span, int))
        for start in range(0, len(layers), size):
            groups.append(KVGroup(kind, span, tuple(layers[start : start + size])))
    return KVLayout(tuple(groups), size * page, per_layer=True)
