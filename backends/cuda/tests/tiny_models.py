"""Tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 and mixture-of-experts (Qwen3-MoE,
Qwen2-MoE, Mixtral, gpt-oss) checkpoints with a trained BPE
tokenizer, written as HF directories at test time (no download)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from engine_core import LLM

VOCAB_SIZE = 384
BOS, EOS = "<s>", "</s>"

_WORDS = [
    "the",
    "a",
    "engine",
    "token",
    "block",
    "cache",
    "model",
    "batch",
    "step",
    "chunk",
    "prefix",
    "decode",
    "prefill",
    "sample",
    "seed",
    "graph",
    "kernel",
    "tensor",
    "layer",
    "head",
    "query",
    "key",
    "value",
    "rotary",
    "norm",
    "weight",
    "paged",
    "memory",
    "device",
    "request",
    "stream",
    "output",
    "prompt",
    "greedy",
    "random",
    "attention",
    "scheduler",
    "queue",
    "slot",
    "table",
]


def corpus(num_lines: int = 400) -> list[str]:
    """Deterministic pseudo-sentences to train the tokenizer on."""
    lines = []
    for i in range(num_lines):
        words = [_WORDS[(i * 7 + j * j * 3 + j) % len(_WORDS)] for j in range(5 + i % 9)]
        lines.append(" ".join(words) + (". " if i % 3 else "? ") + str(i))
    return lines


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer trained on :func:`corpus`, with ``<s>``/``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

KINDS: dict[str, dict[str, Any]] = {
    # Tied embeddings and llama3 RoPE scaling that matters within 512 positions.
    "llama": {
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    # QKV bias; its config.json is rewritten in the published rope_theta/torch_dtype form.
    "qwen2": {"tie_word_embeddings": False, "rope_theta": 1000.0},
    # q/k norm, head_dim (32) != hidden_size / heads, sharded safetensors.
    "qwen3": {"tie_word_embeddings": False, "head_dim": 32, "rope_theta": 1000000.0},
}

WINDOW = 8
"""The sliding window of the windowed tiny models: most prompts are longer."""

WINDOWED_KINDS: dict[str, dict[str, Any]] = {
    # Every layer slides.
    "mistral": {"tie_word_embeddings": False, "sliding_window": WINDOW, "rope_theta": 10000.0},
    # Window and full layers alternating (window first), soft caps small enough to matter,
    # query_pre_attn_scalar != head_dim.
    "gemma2": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 6.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # Two window layers per full one (sliding_window_pattern 3), q/k norms, head_dim (32) !=
    # hidden_size / heads, a RoPE per layer kind (linear scaling on the full layers); its
    # config.json is rewritten in the published spelling (rope_theta, rope_local_base_freq,
    # rope_scaling, sliding_window_pattern, torch_dtype).
    "gemma3": {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    },
}  # fmt: skip

MOE_KINDS: dict[str, dict[str, Any]] = {
    # Renormalised top-2 of 4 experts, q/k norms; layer 1 dense (mlp_only_layers).
    "qwen3_moe": {"tie_word_embeddings": False, "head_dim": 32, "rope_theta": 1000000.0,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "mlp_only_layers": [1]},
    # Top-2 of 4 without renormalisation, the sigmoid-gated shared expert, QKV bias.
    "qwen2_moe": {"tie_word_embeddings": False, "rope_theta": 10000.0, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    # Top-2 of 4 (always renormalised), every layer sparse; w1/w3/w2 names.
    "mixtral": {"tie_word_embeddings": False, "rope_theta": 10000.0, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": None},
    # Window and full layers alternating (window first) with attention sinks, QKV and o biases,
    # YaRN RoPE that matters within 512 positions (truncate off, as gpt-oss), top-2 of 4
    # experts with router and expert biases; its config.json is rewritten in the published
    # spelling (rope_theta, rope_scaling, torch_dtype).
    "gpt_oss": {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW,
                "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 64}},
}  # fmt: skip
ALL_KINDS = {**KINDS, **WINDOWED_KINDS, **MOE_KINDS}

PAGES_PER_BLOCK = {"gemma2": 3, "gemma3": 4, "gpt_oss": 2}
"""The engine core splits these models' layers into this many KV-cache groups (window and full
layers apart; Gemma's of one layer each, gpt-oss's of two), so one block of pages is this many
of the one-group layout's blocks: the tests give them that many more blocks for the same KV
memory."""


def _hf_model(kind: str) -> torch.nn.Module:
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    config = config_cls(**{**_COMMON, **ALL_KINDS[kind]})
    torch.manual_seed(list(ALL_KINDS).index(kind) + 1)
    model = model_cls(config).eval()
    # Gemma's norms scale by 1 + weight: its weights are near 0, the others' near 1.
    norm_base = 0.0 if kind.startswith("gemma") else 1.0
    # Larger than HF's init (std 0.02), so that next-token distributions are far from uniform
    # and greedy choices are not near-ties; norms and biases random too, to test their loading.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(norm_base + 0.1 * torch.randn_like(param))
            elif name.endswith("sinks"):  # large enough to take a share of the softmax
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.25 if name.endswith("bias") else 0.12)
    return model


def _to_published_config(path: Path) -> None:
    """Rewrite config.json the way published checkpoints spell it (rope_theta, torch_dtype)."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype", "float32")
    path.write_text(json.dumps(config, indent=2))


def _to_published_gemma3_config(path: Path) -> None:
    """Rewrite a Gemma 3 config.json as published checkpoints spell it: the full layers' RoPE in
    rope_theta and rope_scaling, the window layers' base in rope_local_base_freq, the layer kinds
    as sliding_window_pattern, torch_dtype."""
    config = json.loads(path.read_text())
    ropes = config.pop("rope_parameters")
    full = dict(ropes["full_attention"])
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_scaling"] = full
    config["rope_local_base_freq"] = ropes["sliding_attention"]["rope_theta"]
    types = config.pop("layer_types")
    config["sliding_window_pattern"] = types.index("full_attention") + 1
    config["torch_dtype"] = config.pop("dtype", "float32")
    path.write_text(json.dumps(config, indent=2))


def build(kind: str, directory: Path) -> torch.nn.Module:
    """Write the tiny ``kind`` checkpoint into ``directory``; returns the HF model (float32)."""
    directory.mkdir(parents=True, exist_ok=True)
    model = _hf_model(kind)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(directory, max_shard_size="40KB" if kind == "qwen3" else "50GB")
    if kind in ("qwen2", "gpt_oss"):
        _to_published_config(directory / "config.json")
    if kind == "gemma3":
        _to_published_gemma3_config(directory / "config.json")
    write_tokenizer(directory)
    return model


def edited_copy(source: Path, target: Path, changes: dict[str, Any]) -> Path:
    """A copy of the model directory ``source`` at ``target`` whose ``config.json`` has the
    fields of ``changes`` replaced (a value of None removes the field)."""
    shutil.copytree(source, target)
    path = target / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        config.pop(key, None)
        if value is not None:
            config[key] = value
    path.write_text(json.dumps(config))
    return target


class TinyModel:
    """A tiny checkpoint on disk and the transformers model it was saved from."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.path = directory
        self.hf = build(kind, directory)

    def llm(self, **fields: Any) -> LLM:
        """An offline engine running this model with the cuda backend on the CPU."""
        options = {"device": "cpu", "kernels": "torch", **fields.pop("backend_options", {})}
        fields.setdefault("max_model_len", 256)
        fields.setdefault("num_kv_blocks", 96 * PAGES_PER_BLOCK.get(self.kind, 1))
        return LLM(model=str(self.path), backend="cuda", backend_options=options, **fields)
