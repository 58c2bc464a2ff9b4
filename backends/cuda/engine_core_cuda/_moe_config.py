"""The mixture-of-experts part of an HF ``config.json`` (no torch): how many experts, how a
token picks them, which layers have them, and how their weights are named in the checkpoint.

| architecture | router | renormalised top-k | shared expert | checkpoint names |
|---|---|---|---|---|
| ``Qwen3MoeForCausalLM`` | softmax | ``norm_topk_prob`` | — | ``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj`` |
| ``Qwen2MoeForCausalLM`` | softmax | ``norm_topk_prob`` | sigmoid-gated (``shared_expert_gate``) | the same, plus ``mlp.shared_expert.*`` |
| ``MixtralForCausalLM`` | softmax | always | — | ``block_sparse_moe.gate``, ``block_sparse_moe.experts.E.w{1,3,2}`` |
| ``GptOssForCausalLM`` | softmax of the top-k biased logits | always | — | ``mlp.router``, stacked ``mlp.experts.{gate_up,down}_proj`` (+ ``_bias``; MXFP4: ``_blocks``/``_scales``) |

gpt-oss's experts compute the clamped SwiGLU ``"swigluoai"`` (``swiglu_alpha``, ``swiglu_limit``)
with biases, on every layer.

``scoring_func`` (``"softmax"`` or ``"sigmoid"``) is read where a config has it. Fields that
change the routing in ways the layer does not implement (grouped or biased top-k, expert-choice
routers, …) are refused with an error naming the field, its value and what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MOE_ARCHITECTURES", "MoeConfig", "moe_config_of"]

MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
SCORING_FUNCS = ("softmax", "sigmoid")

# Config fields whose non-default values ask for routing this layer does not do, with the value
# that means "not used" (any other value is refused).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "router_type": (None, "topk", "token_choice"),
    "moe_router_type": (None, "topk", "token_choice"),
    "expert_choice": (None, False),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """One MoE layer's geometry and routing (every sparse layer of a model shares it)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each routed expert's intermediate size."""
    scoring: str = "softmax"
    """Router scores: ``"softmax"`` over the experts, or an independent ``"sigmoid"`` each."""
    renormalize: bool = False
    """Whether the chosen experts' scores are divided by their sum."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: an always-on expert of this size (0: none), scaled by
    ``sigmoid(shared_expert_gate(x))``."""
    sparse_layers: tuple[int, ...] = ()
    """The layers with experts; the others have the dense MLP of ``intermediate_size``."""
    prefix: str = "mlp"
    """The block's name in the checkpoint (``mlp``, Mixtral's ``block_sparse_moe``)."""
    weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The checkpoint names of each expert's gate, up and down projections."""
    router_bias: bool = False
    """Whether the router's logits have a bias (gpt-oss)."""
    activation: str | None = None
    """The experts' activation when it is not the config's ``hidden_act``: gpt-oss's clamped
    SwiGLU ``"swigluoai"``."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    stacked: bool = False
    """gpt-oss: the checkpoint holds each layer's experts stacked (``experts.gate_up_proj``
    ``[experts, hidden, 2 * inter]`` with gate and up interleaved column by column, and
    ``experts.down_proj`` ``[experts, inter, hidden]``, each with a ``_bias``), not one by one."""


def _positive(hf: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model: {path} has no valid {key!r} (got {value!r})")
    return value


def _check_unsupported(hf: dict[str, Any], path: Path) -> None:
    for key, allowed in _UNSUPPORTED.items():
        value = hf.get(key)
        if value not in allowed:
            supported = ", ".join(repr(v) for v in allowed if v is not None) or "absent"
            raise ValueError(
                f"model: {path} sets {key}={value!r}, which the MoE layer does not support "
                f"(supported: {supported}); supported routing: top-k over "
                f"{'/'.join(SCORING_FUNCS)} scores, optionally renormalised"
            )


def _number(hf: dict[str, Any], key: str, path: Path, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"model: {path} has an invalid {key} {value!r} (a number > 0)")
    return float(value)


def _gpt_oss(hf: dict[str, Any], num_layers: int, path: Path) -> MoeConfig:
    """gpt-oss: ``router`` with a bias, softmax over the top-k logits (the renormalised top-k of
    the softmax), clamped SwiGLU experts with biases on every layer."""
    num_experts = _positive(hf, "num_local_experts", path)
    top_k = _positive(hf, "num_experts_per_tok", path)
    if top_k > num_experts:
        raise ValueError(
            f"model: {path}: num_experts_per_tok ({top_k}) exceeds the number of experts "
            f"({num_experts})"
        )
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive(hf, "intermediate_size", path),
        renormalize=True,
        sparse_layers=tuple(range(num_layers)),
        prefix="mlp",
        weight_names=("gate_up_proj", "gate_up_proj", "down_proj"),
        router_bias=True,
        activation="swigluoai",
        swiglu_alpha=_number(hf, "swiglu_alpha", path, 1.702),
        swiglu_limit=_number(hf, "swiglu_limit", path, 7.0),
        stacked=True,
    )


def moe_config_of(hf: dict[str, Any], architecture: str, num_layers: int, path: Path) -> MoeConfig:
    """The MoE settings of a config of one of :data:`MOE_ARCHITECTURES`. Raises ``ValueError``
    naming the field for an invalid or unsupported value."""
    _check_unsupported(hf, path)
    scoring = hf.get("scoring_func", "softmax")
    if scoring not in SCORING_FUNCS:
        raise ValueError(
            f"model: {path} sets scoring_func={scoring!r}; supported: {', '.join(SCORING_FUNCS)}"
        )
    if architecture == "GptOssForCausalLM":
        return _gpt_oss(hf, num_layers, path)
    mixtral = architecture == "MixtralForCausalLM"
    # Mixtral's name; Qwen's configs say num_experts, and newer transformers write either.
    key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    num_experts = _positive(hf, key, path)
    top_k = _positive(hf, "num_experts_per_tok", path)
    if top_k > num_experts:
        raise ValueError(
            f"model: {path}: num_experts_per_tok ({top_k}) exceeds the number of experts "
            f"({num_experts})"
        )
    if mixtral:
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=_positive(hf, "intermediate_size", path),
            scoring=scoring,
            renormalize=True,
            sparse_layers=tuple(range(num_layers)),
            prefix="block_sparse_moe",
            weight_names=("w1", "w3", "w2"),
        )
    step = _positive(hf, "decoder_sparse_step", path, 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"model: {path} has an invalid mlp_only_layers {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = _positive(hf, "shared_expert_intermediate_size", path)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive(hf, "moe_intermediate_size", path),
        scoring=scoring,
        renormalize=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        sparse_layers=sparse,
    )
