"""The sharding rules (Megatron style) for Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and the
mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss: every rank holds every expert,
with a slice of its intermediate dimension).

| module | split | collective |
|---|---|---|
| ``embed_tokens``, ``lm_head`` (tied or not) | vocab rows, padded to a multiple of the size | embedding: masked lookup + all-reduce; logits: gathered |
| ``q/k/v_proj`` (+ Qwen2's bias) | output rows by whole heads; KV heads split, or replicated when the size exceeds their number (rank r uses KV head ``r // (size / kv_heads)``) | — |
| ``o_proj`` | input columns by heads; bias added once after the reduce | all-reduce |
| ``gate/up_proj`` | output rows | — |
| ``down_proj`` | input columns; bias added once | all-reduce |
| MoE: router (``gate``), Qwen2-MoE's ``shared_expert_gate`` | replicated | — |
| MoE: each expert's ``gate/up_proj`` (Mixtral ``w1/w3``), the shared expert's | output rows (of the expert's intermediate size) | — |
| MoE: each expert's ``down_proj`` (Mixtral ``w2``), the shared expert's | input columns | one all-reduce of the block's sum |
| gpt-oss: stacked ``experts.gate_up_proj`` (+ bias) | the rank's gate/up pairs (interleaved columns, :func:`stacked_expert_part`) | — |
| gpt-oss: stacked ``experts.down_proj`` | input rows; its bias on rank 0 only (the others hold zeros) | one all-reduce of the block's sum |
| gpt-oss: attention ``sinks`` (one logit per query head) | by heads, as ``q_proj`` | — |
| norms (Gemma's four per layer too), rotary, Qwen3's and Gemma 3's q/k norms | replicated | — |

Each rank reads only its slices from the checkpoint, except gpt-oss's stacked experts: a rank reads
a layer's whole tensor (its MXFP4 blocks are dequantised first) and keeps its part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine_core_cuda._hf_config import ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "Slice",
    "padded_vocab_rows",
    "shard_model_config",
    "slice_of",
    "stacked_expert_part",
]


def shard_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """The geometry one rank holds (heads, KV heads and intermediate size divided; the
    vocabulary stays whole: it is what rank 0 samples over). Raises ``ValueError`` naming the
    config field that ``size`` does not divide."""
    if size == 1:
        return config
    problems = []
    if config.num_heads % size:
        problems.append(f"num_attention_heads ({config.num_heads}) % tensor_parallel_size != 0")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(
            f"num_key_value_heads ({kv}) must divide, or be divisible by, tensor_parallel_size"
        )
    if config.intermediate_size % size:
        problems.append(
            f"intermediate_size ({config.intermediate_size}) % tensor_parallel_size != 0"
        )
    moe = config.moe
    if moe is not None:
        if moe.intermediate_size % size:
            problems.append(
                f"moe_intermediate_size ({moe.intermediate_size}) % tensor_parallel_size != 0"
            )
        if moe.shared_expert_intermediate_size % size:
            problems.append(
                f"shared_expert_intermediate_size ({moe.shared_expert_intermediate_size}) "
                "% tensor_parallel_size != 0"
            )
    if config.quantization is not None and config.quantization.strategy == "block":
        problems.append("block-wise FP8 weights are not sharded (load them on one device)")
    if problems:
        raise ValueError(
            f"model: cannot shard {config.architecture} over tensor_parallel_size={size}: "
            + "; ".join(problems)
        )
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size,
        )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, kv // size),
        intermediate_size=config.intermediate_size // size,
        moe=moe,
    )


def padded_vocab_rows(vocab_size: int, size: int) -> int:
    """Vocabulary rows per rank (the last rank's tail is zero padding)."""
    return -(-vocab_size // size)


@dataclass(frozen=True, slots=True)
class Slice:
    """Read ``[start, stop)`` along ``dim`` of a checkpoint tensor; ``rows`` the rank's rows
    (more than ``stop - start`` for a padded vocabulary slice)."""

    dim: int
    start: int
    stop: int
    rows: int


_COLUMN_PARALLEL = ("gate_proj", "up_proj", "w1", "w3")
_ROW_PARALLEL = ("o_proj", "down_proj", "w2")


def _intermediate_size(name: str, config: ModelConfig) -> int:
    """The intermediate size of the MLP that checkpoint tensor ``name`` belongs to: a routed
    expert's, the shared expert's, or the dense MLP's."""
    moe = config.moe
    if moe is not None:
        if ".experts." in name:
            return moe.intermediate_size
        if ".shared_expert." in name:
            return moe.shared_expert_intermediate_size
    return config.intermediate_size


def slice_of(name: str, ndim: int, config: ModelConfig, rank: int, size: int) -> Slice | None:
    """The part of checkpoint tensor ``name`` that ``rank`` holds (None: all of it)."""
    if size == 1:
        return None
    head = config.head_size
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = padded_vocab_rows(config.vocab_size, size)
        start = min(rank * rows, config.vocab_size)
        return Slice(0, start, min(start + rows, config.vocab_size), rows)
    if module == "q_proj":
        n = config.num_heads // size * head
        return Slice(0, rank * n, (rank + 1) * n, n)
    if kind == "sinks":
        n = config.num_heads // size
        return Slice(0, rank * n, (rank + 1) * n, n)
    if module in ("k_proj", "v_proj"):
        kv = config.num_kv_heads
        if kv >= size:
            n = kv // size * head
            return Slice(0, rank * n, (rank + 1) * n, n)
        index = rank // (size // kv)
        return Slice(0, index * head, (index + 1) * head, head)
    inter = _intermediate_size(name, config)
    if module in _COLUMN_PARALLEL:
        n = inter // size
        return Slice(0, rank * n, (rank + 1) * n, n)
    if module in _ROW_PARALLEL and kind == "weight" and ndim == 2:
        total = config.num_heads * head if module == "o_proj" else inter
        n = total // size
        return Slice(1, rank * n, (rank + 1) * n, n)
    return None  # norms, row-parallel biases (added once after the reduce)


StackedPart = Literal["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]


def stacked_expert_part(
    part: StackedPart, tensor: torch.Tensor, rank: int, size: int
) -> torch.Tensor:
    """The part ``rank`` holds of one of gpt-oss's stacked expert tensors, in the checkpoint's
    layout (``gate_up_proj`` ``[experts, hidden, 2 * inter]`` with gate and up interleaved column
    by column, its bias ``[experts, 2 * inter]``, ``down_proj`` ``[experts, inter, hidden]``, its
    bias ``[experts, hidden]``). A rank's intermediate slice ``[rank * n, (rank + 1) * n)`` is the
    contiguous run of columns ``[2 * rank * n, 2 * (rank + 1) * n)`` of the interleaved tensors;
    the down projection's bias is added once to the block's sum, so only rank 0 keeps it."""
    if size == 1:
        return tensor
    if part == "down_proj_bias":
        return tensor if rank == 0 else tensor.new_zeros(tensor.shape)
    if part == "down_proj":
        n = tensor.shape[1] // size
        return tensor[:, rank * n : (rank + 1) * n]
    n = tensor.shape[-1] // size  # 2 * (inter // size): whole gate/up pairs
    return tensor[..., rank * n : (rank + 1) * n]
