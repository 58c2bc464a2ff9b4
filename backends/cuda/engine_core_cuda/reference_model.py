"""A dense, unpaged forward pass of the supported architectures, written from the HF definitions
in plain torch and independent of the backend's model code: the ground truth for greedy parity
on machines without transformers (``bench/gpu_check.py``). It recomputes the whole sequence for
every token, so it is for tiny models only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._rope import inverse_frequencies

__all__ = ["reference_greedy", "reference_logits"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def reference_logits(
    weights: dict[str, torch.Tensor], config: ModelConfig, tokens: list[int]
) -> torch.Tensor:
    """Float32 logits ``[len(tokens), vocab]`` of a sequence, from checkpoint-named
    ``weights`` (e.g. ``model.layers.0.self_attn.q_proj.weight``)."""
    w = weights
    device = w["model.embed_tokens.weight"].device
    n = len(tokens)
    x = w["model.embed_tokens.weight"][torch.tensor(tokens, device=device)]
    inv_freq = inverse_frequencies(config.rope, config.head_size).to(device)
    freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
    group = config.num_heads // config.num_kv_heads
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = _linear(w, p + "self_attn.q_proj", h).view(n, config.num_heads, config.head_size)
        k = _linear(w, p + "self_attn.k_proj", h).view(n, config.num_kv_heads, config.head_size)
        v = _linear(w, p + "self_attn.v_proj", h).view(n, config.num_kv_heads, config.head_size)
        if config.qk_norm:
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], config.rms_norm_eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], config.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = x + _linear(w, p + "self_attn.o_proj", attn.transpose(0, 1).reshape(n, -1))
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate, up = _linear(w, p + "mlp.gate_proj", h), _linear(w, p + "mlp.up_proj", h)
        x = x + _linear(w, p + "mlp.down_proj", F.silu(gate) * up)
    x = _rms_norm(x, w["model.norm.weight"], config.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return F.linear(x, head).float()


def reference_greedy(
    weights: dict[str, torch.Tensor], config: ModelConfig, prompt: list[int], max_tokens: int
) -> list[int]:
    """The greedy continuation of ``prompt`` (``max_tokens`` tokens, no stop token)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(reference_logits(weights, config, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
