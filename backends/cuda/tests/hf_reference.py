"""What transformers computes for the tiny models: greedy ``generate()`` tokens and logprobs."""

from __future__ import annotations

import functools

import torch
from transformers import GenerationConfig

PROMPTS = [
    "the engine",
    "decode prefill batch step chunk prefix cache model",
    "a",
    "graph kernel tensor layer head query key value rotary norm weight paged memory device "
    "request stream output prompt greedy random",
    "token block cache model batch step chunk prefix decode prefill sample seed graph kernel",
]
"""Prompts of different lengths (1 to ~40 tokens with the tiny tokenizer)."""


@functools.cache
def _greedy(model: torch.nn.Module, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    tokens: list[int] = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_tokens, "transformers stopped early"
    return tokens


def greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``max_tokens`` tokens, EOS ignored)."""
    return _greedy(model, tuple(prompt), max_tokens)


def log_softmax(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32 log-softmax of the logits at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(dim=-1)
