"""Multi-LoRA serving: PEFT adapters read into host memory, ``max_loras`` device slots, and the
low-rank updates applied to the projections of a step's tokens by adapter segment.

- :func:`read_adapter` reads a PEFT directory (``adapter_config.json`` +
  ``adapter_model.safetensors``), checks it against the base model (rank, target modules, every
  matrix's shape) and keeps its matrices on the host, ``lora_B`` scaled by ``lora_alpha / r``
  (``lora_alpha / sqrt(r)`` with rsLoRA) and both sliced for this rank under tensor parallelism
  (column-parallel ``q/k/v/gate/up``: ``lora_B``'s rows; row-parallel ``o/down``:
  ``lora_A``'s columns, the partial products then summed by the projection's all-reduce).
- :class:`LoRAModel` holds the device slots: every LoRA-capable projection (:class:`LoRALinear`
  on :attr:`~engine_core_cuda._layers.Linear.lora`) has ``a`` ``[slots, shards * R, in]`` and
  ``b`` ``[slots, out, R]`` (``R = max_lora_rank``; a fused ``qkv_proj`` / ``gate_up_proj``
  stacks one ``A`` per shard and keeps the shards' ``B`` rows where its output has them).
  Before a step, :meth:`LoRAModel.prepare` gives each adapter of the step a slot (least recently
  used first among the slots no request of the step uses), copies the adapters that are not in
  one yet, and sets the step's segments.
- :meth:`LoRALinear.add_to` adds ``x A^T B^T`` to a projection's output: the Triton shrink/expand
  kernels (:mod:`engine_core_cuda.kernels.lora`, capturable in CUDA graphs, whose segment
  tensors are graph inputs) or the torch reference, with the other kernels' choice.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine_core.lora import LORA_TARGET_MODULES, LoRAError
from engine_core_cuda._hf_config import ModelConfig

if TYPE_CHECKING:
    from engine_core_cuda._layers import Linear
    from engine_core_cuda._tp.shard import Slice

__all__ = [
    "HostAdapter",
    "LoRALinear",
    "LoRAMapping",
    "LoRAModel",
    "TARGET_MODULES",
    "random_adapter",
    "read_adapter",
    "served_modules",
]

TARGET_MODULES = LORA_TARGET_MODULES
"""The PEFT target modules served (the attention and dense MLP projections)."""

_FUSED: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"),
}
"""PEFT module -> (the model's projection under the layer, its shard)."""

_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_ADAPTER_FILES = ("adapter_model.safetensors",)


@dataclass(slots=True)
class HostAdapter:
    """An adapter read and checked, in host memory."""

    lora_id: int
    name: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, projection, shard) -> (``A`` ``[r, in]``, ``B`` scaled ``[out, r]``), this rank's
    slices: float32 as read, the model's dtype once published (:meth:`LoRAModel.add_host`)."""
    removed: bool = False
    """:meth:`LoRAModel.remove` was called while requests used it: dropped once they are done."""


def _full_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module -> the base model's (out, in) of its weight (the whole model, unsharded)."""
    q, kv, hidden, inter = (
        config.q_size,
        config.kv_size,
        config.hidden_size,
        config.intermediate_size,
    )
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def served_modules(config: ModelConfig) -> frozenset[str]:
    """The target modules this model serves: the MLP ones only where its layers are dense."""
    if any(config.layer_is_moe(i) for i in range(config.num_layers)):
        return frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
    return TARGET_MODULES


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def read_adapter(
    lora_id: int,
    name: str,
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    slicer: Callable[[str, int], Slice | None] | None = None,
) -> HostAdapter:
    """Read and check the PEFT adapter at ``path`` for the base model ``config`` (the whole
    model's geometry); ``slicer`` gives this rank's part of a base weight under tensor
    parallelism. Raises :class:`LoRAError` naming the adapter and what is wrong."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAError(name, f"adapter directory {str(directory)!r} does not exist")
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoRAError(name, f"{str(directory)!r} has no adapter_config.json")
    try:
        peft: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoRAError(name, f"adapter_config.json cannot be read: {exc}") from exc
    peft_type = str(peft.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(name, f"peft_type {peft_type} is not served (only LORA)")
    if peft.get("use_dora"):
        raise LoRAError(name, "DoRA adapters are not served")
    if peft.get("bias", "none") not in ("none", None):
        raise LoRAError(name, f"bias={peft['bias']!r} is not served (only 'none')")
    for flag in ("lora_bias", "layer_replication", "target_parameters", "trainable_token_indices"):
        if peft.get(flag):
            raise LoRAError(name, f"{flag}={peft[flag]!r} is not served")
    if peft.get("modules_to_save"):
        raise LoRAError(name, f"modules_to_save {peft['modules_to_save']} are not served")
    rank = peft.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoRAError(name, f"adapter_config.json: r must be an int > 0, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(name, f"rank {rank} is above max_lora_rank {max_rank}")
    if peft.get("rank_pattern") or peft.get("alpha_pattern"):
        raise LoRAError(name, "per-module rank_pattern / alpha_pattern are not served")
    alpha = float(peft.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    served = served_modules(config)
    declared = peft.get("target_modules")
    if isinstance(declared, list):
        modules = {str(m).rsplit(".", 1)[-1] for m in declared}
        unserved = sorted(modules - served)
        if unserved:
            raise LoRAError(
                name,
                f"target modules {unserved} are not served (served: {sorted(served)})",
            )
    files = [directory / f for f in _ADAPTER_FILES if (directory / f).is_file()]
    if not files:
        raise LoRAError(name, f"{str(directory)!r} has no adapter_model.safetensors")
    try:
        tensors = _read_tensors(files[0])
    except Exception as exc:  # a corrupt file: safetensors raises its own errors
        raise LoRAError(name, f"adapter_model.safetensors cannot be read: {exc}") from exc
    shapes = _full_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAError(name, f"tensor {key!r} is not a LoRA matrix of a served module")
        layer, module, which = int(match.group(1)), match.group(3), match.group(4)
        if module not in served:
            raise LoRAError(
                name, f"target module {module} is not served (served: {sorted(served)})"
            )
        if layer >= config.num_layers:
            raise LoRAError(
                name,
                f"{key!r}: layer {layer} does not exist: the base model has "
                f"{config.num_layers} layers",
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(name, "adapter_model.safetensors has no LoRA matrices")
    weights: dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(name, f"layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        out_features, in_features = shapes[module]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAError(
                name,
                f"shapes do not fit the base model: layer {layer} {module} has lora_A "
                f"{list(a.shape)} and lora_B {list(b.shape)}, the model needs "
                f"[{rank}, {in_features}] and [{out_features}, {rank}] (another architecture?)",
            )
        a = a.float()
        b = b.float() * scaling
        if slicer is not None:
            part = slicer(
                f"model.layers.{layer}.{_FUSED[module][0].split('.')[0]}.{module}.weight", 2
            )
            if part is not None and part.dim == 0:  # column parallel: this rank's output rows
                b = b[part.start : part.stop]
            elif part is not None:  # row parallel: this rank's input columns
                a = a[:, part.start : part.stop]
        projection, shard = _FUSED[module]
        weights[layer, projection, shard] = (a.contiguous(), b.contiguous())
    targets = frozenset(module for _, module in pairs)
    return HostAdapter(lora_id, name, rank, scaling, targets, weights)


def random_adapter(
    lora_id: int, config: ModelConfig, rank: int, seed: int, std: float = 0.02
) -> HostAdapter:
    """An adapter of random matrices on every served module of ``config`` (benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _full_shapes(config)
    weights = {}
    for layer in range(config.num_layers):
        for module in sorted(served_modules(config)):
            out_features, in_features = shapes[module]
            projection, shard = _FUSED[module]
            weights[layer, projection, shard] = (
                torch.randn(rank, in_features, generator=gen) * std,
                torch.randn(out_features, rank, generator=gen) * std,
            )
    return HostAdapter(lora_id, f"random-{lora_id}", rank, 1.0, served_modules(config), weights)


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    tensor = tensor.to(dtype)
    return tensor.pin_memory() if pin else tensor


@dataclass(slots=True)
class LoRAMapping:
    """A step's adapter segments: device tensors (the kernels' inputs) and their host copy
    (the torch path's)."""

    seg_start: torch.Tensor
    seg_slot: torch.Tensor
    num_segments: int
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    active: bool = False
    """Whether any segment has an adapter (otherwise nothing is computed)."""


class LoRALinear(nn.Module):
    """The device slots of one projection: ``a`` ``[slots, shards * R, in]``, ``b``
    ``[slots, out, R]``; ``shards``: (first output row, rows) of each shard, in the order
    of ``a``'s rank blocks."""

    def __init__(
        self,
        owner: LoRAModel,
        linear: Linear,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.owner = [owner]  # a list: not a submodule
        out_features, in_features = linear.weight.shape
        self.shard_names = list(linear.shards)
        self.shards = [linear.shards[s] for s in self.shard_names]
        self.max_rank = max_rank
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.device = dtype, device
        self.register_buffer("a", None, persistent=False)
        self.register_buffer("b", None, persistent=False)
        self.a: torch.Tensor
        self.b: torch.Tensor
        self.allocate(num_slots)

    def allocate(self, num_slots: int) -> None:
        """Empty slots (zeros)."""
        n, r = len(self.shards), self.max_rank
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        self.a = torch.zeros(num_slots, n * r, self.in_features, **kw)
        self.b = torch.zeros(num_slots, self.out_features, r, **kw)

    def load_slot(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's matrices of this projection (shard -> (A, B)) into ``slot``; the
        shards it leaves out are zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        non_blocking = self.a.device.type == "cuda"
        for i, name in enumerate(self.shard_names):
            if name not in parts:
                continue
            a, b = parts[name]
            r = a.shape[0]
            start, rows = self.shards[i]
            lo = i * self.max_rank
            self.a[slot, lo : lo + r].copy_(a, non_blocking=non_blocking)
            self.b[slot, start : start + rows, :r].copy_(b, non_blocking=non_blocking)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += x A^T B^T`` for the tokens of the step's adapter segments."""
        owner = self.owner[0]
        mapping = owner.mapping
        if not mapping.active and not owner.capturing:
            return
        num_tokens = x.shape[0]
        y = owner.shrink_buffer(num_tokens, self.a.shape[1])
        r = self.max_rank
        if owner.impl == "triton":
            from engine_core_cuda.kernels.lora import lora_expand, lora_shrink

            args = (mapping.seg_start, mapping.seg_slot, mapping.num_segments)
            lora_shrink(x, self.a, y, *args)
            lora_expand(y, self.b, out, *args, self.shards)
            return
        from engine_core_cuda.kernels.lora_torch import lora_expand_torch, lora_shrink_torch

        segments = mapping.segments
        lora_shrink_torch(x, self.a, y, segments)
        for i, (start, rows) in enumerate(self.shards):
            lora_expand_torch(
                y[:, i * r : (i + 1) * r], self.b[:, start : start + rows],
                out[:, start : start + rows], segments,
            )  # fmt: skip


class LoRAModel:
    """The adapters of one model: read ones in host memory, ``num_slots`` device slots
    assigned least recently used first, and the step's mapping the projections read."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        max_tokens: int,
        impl: str,
        dtype: torch.dtype,
        device: torch.device,
        slicer: Callable[[str, int], Slice | None] | None = None,
    ) -> None:
        from engine_core_cuda._layers import Linear

        if num_slots <= 0 or max_rank <= 0:
            raise ValueError(
                f"max_loras and max_lora_rank must be > 0, got {num_slots}, {max_rank}"
            )
        self.config = config
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.impl = impl
        self.device = device
        self.slicer = slicer
        self.served = served_modules(config)
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        layers: Any = model.model.layers  # type: ignore[union-attr]
        for i, layer in enumerate(layers):
            for projection in {p for p, _ in _FUSED.values()}:
                block, attr = projection.split(".")
                linear = getattr(getattr(layer, block, None), attr, None)
                if not isinstance(linear, Linear):
                    continue
                lora = LoRALinear(self, linear, num_slots, max_rank, dtype, device)
                linear.lora = lora
                self.layers[i, projection] = lora
        self.adapters: dict[int, HostAdapter] = {}
        self._lock = threading.Lock()
        self.slots: list[int | None] = [None] * num_slots
        """Slot -> the adapter id in it."""
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        """Slots, least recently used first."""
        self.request_lora: dict[str, int] = {}
        """Request id -> its adapter id (0: base), until the request finishes."""
        seg = torch.zeros(max_tokens + 1, dtype=torch.int32, device=device)
        self.mapping = LoRAMapping(
            seg, torch.full((max_tokens,), -1, dtype=torch.int32, device=device), 0
        )
        self.capturing = False
        """Set while CUDA graphs are captured: the kernels are recorded even with no adapter."""
        self._y = torch.zeros(max_tokens, 3 * max_rank, dtype=torch.float32, device=device)
        """The float32 intermediate of the shrink (one buffer: the projections run one after
        another)."""

    # -- adapters ---------------------------------------------------------------------------

    def add(self, lora_id: int, name: str, path: str) -> None:
        """Read and check an adapter (outside the lock: steps go on meanwhile)."""
        if lora_id <= 0:
            raise LoRAError(name, f"lora_int_id must be > 0 (0 is the base model), got {lora_id}")
        self.add_host(read_adapter(lora_id, name, path, self.config, self.max_rank, self.slicer))

    def add_host(self, adapter: HostAdapter) -> None:
        """Publish an adapter already in host memory (read and checked), its matrices in the
        model's dtype (pinned for a GPU: the slot copies are then asynchronous)."""
        dtype = next(iter(self.layers.values())).dtype if self.layers else torch.float32
        pin = self.device.type == "cuda"
        adapter.weights = {
            key: (_host_copy(a, dtype, pin), _host_copy(b, dtype, pin))
            for key, (a, b) in adapter.weights.items()
        }
        lora_id = adapter.lora_id
        with self._lock:
            old = self.adapters.get(lora_id)
            self.adapters[lora_id] = adapter
            if old is not None:  # replaced: its slot is stale
                self._evict(lora_id)

    def remove(self, lora_id: int) -> None:
        """Forget an adapter; requests that use it keep it (and its slot) until they finish."""
        with self._lock:
            adapter = self.adapters.get(lora_id)
            if adapter is None:
                return
            if lora_id in self.request_lora.values():
                adapter.removed = True
                return
            del self.adapters[lora_id]
            self._evict(lora_id)

    def release(self) -> None:
        """Free the device slots (the backend sleeps); the adapters stay in host memory and go
        back into slots as steps need them after :meth:`restore`."""
        with self._lock:
            self.slots = [None] * self.num_slots
            for lora in self.layers.values():
                lora.a = torch.empty(0, dtype=lora.a.dtype, device=lora.a.device)
                lora.b = torch.empty(0, dtype=lora.b.dtype, device=lora.b.device)

    def restore(self) -> None:
        """Allocate the device slots again, empty."""
        with self._lock:
            for lora in self.layers.values():
                lora.allocate(self.num_slots)

    def _evict(self, lora_id: int) -> None:
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot] = None
                self._lru.move_to_end(slot, last=False)

    def track(self, new: Iterable[tuple[str, int]], finished: Iterable[str]) -> None:
        """Follow the requests' adapters: new (request, adapter id) pairs and finished
        requests; drops removed adapters no request uses any more."""
        with self._lock:
            for req_id in finished:
                self.request_lora.pop(req_id, None)
            for req_id, lora_id in new:
                if lora_id:
                    adapter = self.adapters.get(lora_id)
                    if adapter is None:
                        raise RuntimeError(
                            f"request {req_id!r} uses LoRA adapter {lora_id}, which is not "
                            "loaded (add_lora)"
                        )
                    self.request_lora[req_id] = lora_id
                else:
                    self.request_lora.pop(req_id, None)
            used = set(self.request_lora.values())
            for lora_id, adapter in list(self.adapters.items()):
                if adapter.removed and lora_id not in used:
                    del self.adapters[lora_id]
                    self._evict(lora_id)

    # -- steps ------------------------------------------------------------------------------

    def assign(self, lora_ids: Iterable[int], keep: Iterable[int] = ()) -> dict[int, int]:
        """A slot for each adapter id (0 excluded), copying those not in one into the least
        recently used free slot, sparing those of ``keep`` (the running requests' adapters,
        ``SchedulerOutput.lora_ids``) while another is free."""
        wanted = list(dict.fromkeys(i for i in lora_ids if i))
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a step uses {len(wanted)} LoRA adapters but max_loras is {self.num_slots}"
            )
        with self._lock:
            where = {held: slot for slot, held in enumerate(self.slots) if held is not None}
            result: dict[int, int] = {}
            for lora_id in wanted:
                if lora_id in where:
                    result[lora_id] = where[lora_id]
            taken = set(result.values())
            for lora_id in wanted:
                if lora_id in result:
                    continue
                adapter = self.adapters.get(lora_id)
                if adapter is None:
                    raise RuntimeError(f"LoRA adapter {lora_id} is not loaded (add_lora)")
                spared = set(keep)
                free = [s for s in self._lru if s not in taken]
                slot = next((s for s in free if self.slots[s] not in spared), free[0])
                self._load(slot, adapter)
                result[lora_id] = slot
                taken.add(slot)
            for slot in result.values():
                self._lru.move_to_end(slot)
            return result

    def _load(self, slot: int, adapter: HostAdapter) -> None:
        by_projection: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, projection, shard), ab in adapter.weights.items():
            by_projection.setdefault((layer, projection), {})[shard] = ab
        for key, lora in self.layers.items():
            lora.load_slot(slot, by_projection.get(key, {}))
        self.slots[slot] = adapter.lora_id

    def prepare(
        self, lora_ids: list[int], query_start_loc: list[int], keep: Iterable[int] = ()
    ) -> None:
        """The step's mapping: ``lora_ids`` per request (batch order), the requests' token
        offsets (``len(lora_ids) + 1``). Consecutive requests of one adapter make one
        segment."""
        mapping = self.mapping
        if not any(lora_ids):
            mapping.active = False
            mapping.num_segments = 0
            mapping.segments = []
            return
        slot_of = self.assign(lora_ids, keep)
        segments: list[tuple[int, int, int]] = []
        for i, lora_id in enumerate(lora_ids):
            slot = slot_of[lora_id] if lora_id else -1
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if segments and segments[-1][2] == slot and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], end, slot)
            else:
                segments.append((start, end, slot))
        starts = [s for s, _, _ in segments] + [segments[-1][1]]
        slots = [s for _, _, s in segments]
        self._write(starts, slots)
        mapping.num_segments = len(segments)
        mapping.segments = segments
        mapping.active = True

    def _write(self, starts: list[int], slots: list[int]) -> None:
        mapping = self.mapping
        host = torch.tensor(starts + slots, dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        mapping.seg_start[: len(starts)].copy_(host[: len(starts)])
        mapping.seg_slot[: len(slots)].copy_(host[len(starts) :])

    def shrink_buffer(self, num_tokens: int, ranks: int) -> torch.Tensor:
        """The float32 intermediate ``[num_tokens, ranks]``."""
        if self._y.shape[0] < num_tokens:  # a step larger than max_num_batched_tokens
            self._y = torch.zeros(num_tokens, self._y.shape[1], dtype=torch.float32,
                                  device=self.device)  # fmt: skip
        return self._y[:num_tokens, :ranks]

    def prepare_graph(
        self, lora_ids: list[int], num_padded: int, query_len: int, keep: Iterable[int] = ()
    ) -> None:
        """A CUDA graph's mapping: one segment per request of ``query_len`` tokens, padded to
        ``num_padded`` requests of the base model (the graph was captured for that many)."""
        slot_of = self.assign(lora_ids, keep) if any(lora_ids) else {}
        slots = [slot_of[i] if i else -1 for i in lora_ids]
        slots += [-1] * (num_padded - len(slots))
        starts = [i * query_len for i in range(num_padded + 1)]
        self._write(starts, slots)
        mapping = self.mapping
        mapping.num_segments = num_padded
        mapping.segments = [(starts[i], starts[i + 1], slot) for i, slot in enumerate(slots)]
        mapping.active = True
