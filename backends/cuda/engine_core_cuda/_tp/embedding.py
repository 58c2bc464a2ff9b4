"""The vocab-parallel embedding: each rank holds a slice of the rows; ids outside it look up
zeros, and the all-reduce adds the slices (exact: every other rank adds zeros)."""

from __future__ import annotations

import torch
from torch import nn

from engine_core_cuda._tp.parallel import TensorParallel
from engine_core_cuda._tp.shard import padded_vocab_rows

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Embedding):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        rows = padded_vocab_rows(vocab_size, parallel.size)
        super().__init__(rows, hidden_size, dtype=dtype, device=device)
        self.parallel = parallel
        self.first = parallel.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(x)
