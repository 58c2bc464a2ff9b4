"""A dense, unpaged forward pass of the supported architectures (the Llama family, Mistral's
sliding window, Gemma 2 and Gemma 3), written from the HF definitions in plain torch and
independent of the backend's model code: the ground truth for greedy parity on machines without
transformers (``bench/gpu_check.py``). It recomputes the whole sequence for every token, so it
is for tiny models only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._rope import inverse_frequencies

__all__ = ["reference_greedy", "reference_logits"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # (1 + w) in float32, one rounding
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig,
               layer: int) -> torch.Tensor:  # fmt: skip
    """``[n, heads, D]`` queries over the keys of positions ``0 .. n - 1`` with the layer's
    scale, soft cap and mask (causal, then its window or chunk)."""
    kind = config.layer_attention(layer)
    n = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * kind.scale
    if kind.softcap is not None:
        scores = kind.softcap * torch.tanh(scores / kind.softcap)
    query = torch.arange(n, device=q.device)[:, None]
    key = torch.arange(n, device=q.device)[None, :]
    visible = key <= query
    if kind.window is not None:
        visible &= key > query - kind.window
    if kind.chunk is not None:
        visible &= key // kind.chunk == query // kind.chunk
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


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
    gemma, eps = config.is_gemma, config.rms_norm_eps
    x = w["model.embed_tokens.weight"][torch.tensor(tokens, device=device)]
    if gemma:
        x = x * torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(x.dtype)
    group = config.num_heads // config.num_kv_heads
    act = (lambda g: F.gelu(g, approximate="tanh")) if config.hidden_act != "silu" else F.silu

    def norm(h: torch.Tensor, name: str) -> torch.Tensor:
        return _rms_norm(h, w[name], eps, gemma)

    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        inv_freq = inverse_frequencies(config.layer_rope(i), config.head_size).to(device)
        freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
        h = norm(x, p + "input_layernorm.weight")
        q = _linear(w, p + "self_attn.q_proj", h).view(n, config.num_heads, config.head_size)
        k = _linear(w, p + "self_attn.k_proj", h).view(n, config.num_kv_heads, config.head_size)
        v = _linear(w, p + "self_attn.v_proj", h).view(n, config.num_kv_heads, config.head_size)
        if config.qk_norm:
            q = norm(q, p + "self_attn.q_norm.weight")
            k = norm(k, p + "self_attn.k_norm.weight")
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        attn = _linear(w, p + "self_attn.o_proj", _attention(q, k, v, config, i).reshape(n, -1))
        if gemma:
            x = x + norm(attn, p + "post_attention_layernorm.weight")
            h = norm(x, p + "pre_feedforward_layernorm.weight")
        else:
            x = x + attn
            h = norm(x, p + "post_attention_layernorm.weight")
        gate, up = _linear(w, p + "mlp.gate_proj", h), _linear(w, p + "mlp.up_proj", h)
        mlp = _linear(w, p + "mlp.down_proj", act(gate) * up)
        x = x + (norm(mlp, p + "post_feedforward_layernorm.weight") if gemma else mlp)
    x = norm(x, "model.norm.weight")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = F.linear(x, head).float()
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * torch.tanh(logits / cap)


def reference_greedy(
    weights: dict[str, torch.Tensor], config: ModelConfig, prompt: list[int], max_tokens: int
) -> list[int]:
    """The greedy continuation of ``prompt`` (``max_tokens`` tokens, no stop token)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(reference_logits(weights, config, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
