"""CUDA graphs of decode steps: one graph per padded batch size, replayed instead of launching
the forward pass kernel by kernel.

A decode batch of ``B`` requests (one token each) runs in the graph of the smallest captured
size ``N >= B``. The graph reads static input buffers; the ``N - B`` padding entries are
sequences of one token whose slot is -1 (nothing is written) and whose block-table row is the
persistent batch's all-zero padding row. The graphs capture the forward pass and the logits;
sampling runs outside them. Every graph writes its logits into rows of one shared float32 buffer
(``[max batch, vocab]``), so the batch sizes do not each keep their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine_core_cuda._attention import AttentionContext

if TYPE_CHECKING:
    from engine_core_cuda._model_runner import ModelRunner
    from engine_core_cuda._step_inputs import StepInputs

__all__ = ["DecodeGraphs", "graph_batch_sizes", "logits_buffer_bytes"]

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to ``max_batch_size`` (always included)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


def logits_buffer_bytes(max_batch_size: int, vocab_size: int) -> int:
    """Bytes of the float32 logits buffer the graphs share."""
    return max_batch_size * vocab_size * 4


class DecodeGraphs:
    """Captured decode graphs of a :class:`~engine_core_cuda._model_runner.ModelRunner`."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        device = runner.device
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_rows = torch.full((n,), runner.batch.padding_row, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        vocab = runner.model_config.vocab_size
        self.logits = torch.empty((n, vocab), dtype=torch.float32, device=device)
        self.reserved_bytes = 0
        """Device memory the capture reserved (graph pool and shared buffers), set by
        :meth:`capture`."""
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self) -> None:
        """Capture every batch size, largest first (later graphs reuse its memory pool)."""
        runner = self.runner
        device = runner.device
        on_gpu = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if on_gpu else 0
        before = reserved - self.logits.numel() * 4
        for n in reversed(self.batch_sizes):
            ctx = AttentionContext(
                ops=runner.ops,
                slot_mapping=self.slot_mapping[:n],
                block_table=runner.batch.block_table,
                seq_rows=self.seq_rows[:n],
                query_start_loc=self.query_start_loc[: n + 1],
                seq_lens=self.seq_lens[:n],
                max_query_len=1,
                num_segments=runner.num_segments(n, 1, runner.max_model_len),
            )

            def forward(n: int = n, ctx: AttentionContext = ctx) -> torch.Tensor:
                hidden = runner.model(self.input_ids[:n], self.positions[:n], runner.kv_caches, ctx)
                return runner.model.compute_logits(hidden, out=self.logits[:n])

            self._graphs[n] = self._record(forward)
        self.reserved_bytes = (torch.cuda.memory_reserved(device) if on_gpu else 0) - before
        logger.info("captured %d decode CUDA graphs (batch sizes %s), %.2f GiB reserved",
                    len(self._graphs), self.batch_sizes, self.reserved_bytes / 2**30)  # fmt: skip

    def _record(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture ``forward`` (which reads the static buffers) in a CUDA graph: returns the
        replay function and the graph's output tensor."""
        device = self.runner.device
        if self._pool is None or self._stream is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the kernels and settles the allocator
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            output = forward()
        torch.cuda.synchronize(device)
        return graph.replay, output

    def can_run(self, step: StepInputs) -> bool:
        return step.is_decode_only and len(step.states) <= self.max_batch_size

    def run(self, step: StepInputs) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode step of ``B`` requests."""
        b = len(step.states)
        n = next(size for size in self.batch_sizes if size >= b)
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.slot_mapping[:b].copy_(step.slot_mapping)
        self.seq_rows[:b].copy_(step.seq_rows)
        self.seq_lens[:b].copy_(step.seq_lens)
        if n > b:
            self.slot_mapping[b:n].fill_(-1)
            self.seq_rows[b:n].fill_(self.runner.batch.padding_row)
            self.seq_lens[b:n].fill_(1)
            self.positions[b:n].zero_()
            self.input_ids[b:n].zero_()
        replay, logits = self._graphs[n]
        replay()
        return logits[:b]
