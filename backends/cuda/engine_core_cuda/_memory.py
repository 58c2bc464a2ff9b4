"""Sizing the KV cache: a profiling forward pass measures the activation peak of the largest
step, and the cache gets ``free memory x kv_cache_memory_fraction`` minus that peak and minus what
the decode CUDA graphs will keep (their shared logits buffer and the activations of the largest
captured batch, measured by a decode-shaped profiling pass).

The profiling batch is the worst case the scheduler can send: ``max_num_batched_tokens`` tokens
over ``max_num_seqs`` sequences, every request sampling with every stage enabled. It writes no
KV (slots -1) and reads one dummy block, so it needs no real cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core_cuda._attention import AttentionContext
from engine_core_cuda._cuda_graphs import logits_buffer_bytes
from engine_core_cuda._device import free_memory_bytes
from engine_core_cuda._options import CPU_DEFAULT_KV_CACHE_BYTES
from engine_core_cuda._sampler import SamplingBatch, compute_logprobs, sample

if TYPE_CHECKING:
    from engine_core_cuda._model_runner import ModelRunner

__all__ = ["available_kv_cache_memory", "graph_max_batch_size", "profile_run"]

logger = logging.getLogger(__name__)


def _dummy_lengths(num_tokens: int, num_seqs: int, max_len: int) -> list[int]:
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    lengths = [base + (1 if i < extra else 0) for i in range(num_seqs)]
    if max(lengths) > max_len:
        lengths = [max_len] * (num_tokens // max_len) + (
            [num_tokens % max_len] if num_tokens % max_len else []
        )
    return lengths


def profile_run(runner: ModelRunner, num_tokens: int, num_seqs: int) -> None:
    """Run the model and the sampler once on a worst-case dummy batch."""
    device = runner.device
    config = runner.model_config
    lengths = _dummy_lengths(num_tokens, num_seqs, runner.max_model_len)
    total = sum(lengths)
    qsl = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=qsl[1:])
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(device)
    dummy_block = torch.zeros(
        (1, runner.block_size, config.num_kv_heads, config.head_size),
        dtype=runner.kv_dtype,
        device=device,
    )
    no_slots = torch.full((total,), -1, dtype=torch.int64, device=device)
    ctx = AttentionContext(
        ops=runner.ops,
        slot_mappings=(no_slots,) * runner.batch.num_kv_groups,
        block_tables=tuple(runner.batch.block_tables),
        seq_rows=torch.full(
            (len(lengths),), runner.batch.padding_row, dtype=torch.int32, device=device
        ),  # fmt: skip
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        max_query_len=max(lengths),
    )
    caches = [(dummy_block, dummy_block)] * config.num_layers
    input_ids = torch.zeros(total, dtype=torch.int64, device=device)
    hidden = runner.model(input_ids, positions.long(), caches, ctx)
    logits = runner.model.compute_logits(hidden[ctx.query_start_loc[1:].long() - 1])
    rows = logits.shape[0]
    vocab = config.vocab_size
    full = torch.ones(rows, dtype=torch.float32, device=device)
    batch = SamplingBatch(
        seeds=torch.zeros(rows, dtype=torch.int64, device=device),
        positions=torch.zeros(rows, dtype=torch.int64, device=device),
        all_greedy=False,
        greedy=torch.zeros(rows, dtype=torch.bool, device=device),
        temperature=full,
        top_k=torch.full((rows,), vocab, dtype=torch.int64, device=device),
        top_p=full * 0.9,
        min_p=full * 0.01,
        presence_penalty=full * 0.1,
        frequency_penalty=full * 0.1,
        repetition_penalty=full * 1.1,
        output_counts=torch.zeros(rows, vocab, dtype=torch.int32, device=device),
        prompt_mask=torch.zeros(rows, vocab, dtype=torch.bool, device=device),
    )
    tokens = sample(logits, batch, runner.ops.impl)
    compute_logprobs(logits, tokens, 20)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_max_batch_size(runner: ModelRunner) -> int:
    """The largest decode batch captured in a CUDA graph; 0 when no graphs will be captured."""
    options = runner.options
    if not (options.cuda_graphs and runner.device.type == "cuda" and runner.ops.graph_capturable):
        return 0
    return min(options.max_graph_batch_size, runner.config.max_num_seqs)


def _peak_bytes(runner: ModelRunner, num_tokens: int, num_seqs: int) -> int:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        profile_run(runner, num_tokens, num_seqs)
    return torch.cuda.max_memory_allocated(device) - baseline


def available_kv_cache_memory(runner: ModelRunner, fraction: float) -> int:
    """Bytes for the KV cache: ``kv_cache_bytes`` when given; on a GPU, free memory after the
    weights and a profiling pass times ``fraction``, minus the pass's activation peak; on the
    CPU, available RAM times ``fraction``, capped at :data:`CPU_DEFAULT_KV_CACHE_BYTES`."""
    if runner.options.kv_cache_bytes is not None:
        return runner.options.kv_cache_bytes
    device = runner.device
    if device.type != "cuda":
        return min(int(free_memory_bytes(device) * fraction), CPU_DEFAULT_KV_CACHE_BYTES)
    config = runner.config
    resolved = config.resolved(model_max_len=runner.model_config.max_model_len)
    assert resolved.max_num_batched_tokens is not None
    peak = _peak_bytes(runner, resolved.max_num_batched_tokens, config.max_num_seqs)
    max_graph = graph_max_batch_size(runner)
    graphs = 0
    if max_graph:
        # The graph pool keeps the largest graph's activations; the logits buffer is shared.
        graphs = _peak_bytes(runner, max_graph, max_graph) + logits_buffer_bytes(
            max_graph, runner.model_config.vocab_size
        )
    torch.cuda.empty_cache()
    free = free_memory_bytes(device)
    available = int(free * fraction) - peak - graphs
    logger.info(
        "KV cache memory: %.2f GiB (free %.2f GiB x %.2f - activation peak %.2f GiB - "
        "CUDA graphs %.2f GiB)",
        available / 2**30, free / 2**30, fraction, peak / 2**30, graphs / 2**30,
    )  # fmt: skip
    return available
