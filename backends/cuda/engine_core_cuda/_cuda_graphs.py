"""CUDA graphs of decode steps: one graph per padded batch size and query length, replayed
instead of launching the forward pass kernel by kernel.

A decode batch of ``B`` requests (one token each) runs in the graph of the smallest captured
size ``N >= B``. The graph reads static input buffers; the ``N - B`` padding entries are
sequences of one token whose slot is -1 (nothing is written) and whose block-table row is the
persistent batch's all-zero padding row. The graphs capture the forward pass and the logits;
sampling runs outside them. Every graph writes its logits into rows of one shared float32 buffer
(``[max batch, vocab]``), so the batch sizes do not each keep their own.

With speculative decoding a step verifies drafts: each request computes ``1 + s`` tokens. Such a
step runs in a graph of query length ``q = 1 + k`` (``k`` from the allowed draft counts, the
smallest that fits the step's most drafts): every request takes ``q`` token slots, its own
``1 + s`` tokens then filler tokens that continue its positions but write no KV (slot -1).
Causal attention keeps the real tokens from seeing the fillers, and only the real tokens' logits
are returned, so padding changes no output. Graphs of query length ``q`` are captured for the
batch sizes whose ``N * q`` tokens fit the largest decode batch, so the buffers stay as large
as without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_core_cuda._attention import AttentionContext, KVCache

if TYPE_CHECKING:
    from engine_core_cuda._draft_model import DraftModel
    from engine_core_cuda._lora import LoRAModel
    from engine_core_cuda._model import CausalLM
    from engine_core_cuda._model_runner import ModelRunner
    from engine_core_cuda._step_inputs import StepInputs

__all__ = ["DecodeGraphs", "graph_batch_sizes", "graph_shapes", "logits_buffer_bytes"]

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to ``max_batch_size`` (always included)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


def graph_shapes(max_batch_size: int, query_lens: list[int]) -> list[tuple[int, int]]:
    """The (batch size, query length) pairs captured: for query length ``q`` the batch sizes of
    :func:`graph_batch_sizes` for ``max_batch_size // q`` (so no graph has more tokens than the
    largest decode batch)."""
    return [
        (n, q)
        for q in sorted(set(query_lens))
        if max_batch_size // q >= 1
        for n in graph_batch_sizes(max_batch_size // q)
    ]


def logits_buffer_bytes(max_batch_size: int, vocab_size: int) -> int:
    """Bytes of the float32 logits buffer the graphs share."""
    return max_batch_size * vocab_size * 4


class DecodeGraphs:
    """Captured decode graphs of a :class:`~engine_core_cuda._model_runner.ModelRunner`."""

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: list[int],
        query_lens: list[int] | None = None,
        *,
        shapes: list[tuple[int, int]] | None = None,
        drafter: DraftModel | None = None,
    ) -> None:
        """``batch_sizes``: those of query length 1; ``query_lens``: more query lengths (1 +
        draft counts) captured for :func:`graph_shapes`; ``shapes``: more (batch size, query
        length) pairs, as given (a benchmark's); ``drafter``: capture the runner's draft model
        (its model and KV cache) instead of the target."""
        self.runner = runner
        self.drafter = drafter
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        extra = graph_shapes(self.max_batch_size, query_lens or []) + (shapes or [])
        self.shapes = [(size, 1) for size in self.batch_sizes] + sorted(
            {shape for shape in extra if shape[1] > 1}, key=lambda shape: (shape[1], shape[0])
        )
        self.query_lens = sorted({q for _, q in self.shapes})
        n = max(size for size, _ in self.shapes)
        tokens = max(size * q for size, q in self.shapes)
        device = runner.device
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mappings = [
            torch.full((tokens,), -1, dtype=torch.int64, device=device)
            for _ in range(runner.batch.num_kv_groups)
        ]
        self.seq_rows = torch.full((n,), runner.batch.padding_row, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._query_start_locs = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q for q in self.query_lens
        }
        vocab = runner.model_config.vocab_size
        self.logits = torch.empty((tokens, vocab), dtype=torch.float32, device=device)
        self.reserved_bytes = 0
        """Device memory the capture reserved (graph pool and shared buffers), set by
        :meth:`capture`."""
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self) -> None:
        """Capture every shape, most tokens first (later graphs reuse its memory pool)."""
        runner = self.runner
        device = runner.device
        on_gpu = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if on_gpu else 0
        before = reserved - self.logits.numel() * 4
        lora = runner.lora if self.drafter is None else None
        if lora is not None:  # LoRA kernels recorded for every slot; no adapter until a replay
            lora.capturing = True
            lora.mapping.seg_slot.fill_(-1)
        try:
            self._capture_all(lora)
        finally:
            if lora is not None:
                lora.capturing = False
        self.reserved_bytes = (torch.cuda.memory_reserved(device) if on_gpu else 0) - before
        logger.info("captured %d decode CUDA graphs (batch sizes %s, query lengths %s), "
                    "%.2f GiB reserved", len(self._graphs), self.batch_sizes, self.query_lens,
                    self.reserved_bytes / 2**30)  # fmt: skip

    def _capture_all(self, lora: LoRAModel | None) -> None:
        runner = self.runner
        for n, q in sorted(self.shapes, key=lambda shape: (-shape[0] * shape[1], shape[1])):
            t = n * q
            ctx = AttentionContext(
                ops=runner.ops,
                slot_mappings=tuple(slots[:t] for slots in self.slot_mappings),
                block_tables=tuple(runner.batch.block_tables),
                seq_rows=self.seq_rows[:n],
                query_start_loc=self._query_start_locs[q][: n + 1],
                seq_lens=self.seq_lens[:n],
                max_query_len=q,
                num_segments=runner.num_segments(n, q, runner.max_model_len),
                span_segments=runner.span_segments(n, q, runner.max_model_len),
            )

            def forward(t: int = t, n: int = n, ctx: AttentionContext = ctx) -> torch.Tensor:
                if lora is not None:  # the graph's grid: one segment per padded request
                    lora.mapping.num_segments = n
                model, caches = self._model()
                hidden = model(self.input_ids[:t], self.positions[:t], caches, ctx)
                return model.compute_logits(hidden, out=self.logits[:t])

            self._graphs[n, q] = self._record(forward)

    def _model(self) -> tuple[CausalLM, list[KVCache]]:
        if self.drafter is not None:
            return self.drafter.model, self.drafter.kv_caches
        return self.runner.model, self.runner.kv_caches

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
        return self._shape(step) is not None

    def _shape(self, step: StepInputs) -> tuple[int, int] | None:
        """The captured (batch size, query length) that runs ``step``, if any: a decode step,
        or one whose every request verifies drafts after its last known token (``1 + s``
        tokens, ``s`` possibly 0) and whose padded positions stay within ``max_model_len``."""
        b = len(step.states)
        if step.draft_rows is None:
            if not step.is_decode_only:
                return None
            return next(((n, 1) for n in self.batch_sizes if n >= b), None)
        counts = np.diff(step.query_start_loc_host)
        if not all(step.samples) or not np.array_equal(counts, np.diff(step.draft_rows.row_start)):
            return None
        need = step.max_query_len
        for q in self.query_lens:
            if q < need:
                continue
            if max(step.starts) + q > self.runner.max_model_len:
                return None
            n = next((n for n, size_q in self.shapes if size_q == q and n >= b), None)
            if n is not None:
                return n, q
        return None

    def run(
        self, step: StepInputs, lora_ids: list[int] | None = None, keep: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Logits of a step :meth:`can_run`: ``[B, vocab]`` for a decode step, else each
        request's ``1 + s`` rows (``step.draft_rows``'s layout). ``lora_ids``: each request's
        adapter (0: the base model), written into the graph's segment inputs; ``keep``: the
        running requests' adapters, spared when a slot is taken."""
        shape = self._shape(step)
        assert shape is not None
        n, q = shape
        b = len(step.states)
        lora = self.runner.lora if self.drafter is None else None
        if lora is not None:
            lora.prepare_graph(lora_ids or [0] * b, n, q, keep)
        if q == 1 and step.draft_rows is None:
            self.input_ids[:b].copy_(step.input_ids)
            self.positions[:b].copy_(step.positions)
            for slots, step_slots in zip(self.slot_mappings, step.slot_mappings, strict=True):
                slots[:b].copy_(step_slots)
            self.seq_rows[:b].copy_(step.seq_rows)
            self.seq_lens[:b].copy_(step.seq_lens)
            if n > b:
                for slots in self.slot_mappings:
                    slots[b:n].fill_(-1)
                self.seq_rows[b:n].fill_(self.runner.batch.padding_row)
                self.seq_lens[b:n].fill_(1)
                self.positions[b:n].zero_()
                self.input_ids[b:n].zero_()
            replay, logits = self._graphs[n, 1]
            replay()
            return logits[:b]
        return self._run_padded(step, n, q)

    def _run_padded(self, step: StepInputs, n: int, q: int) -> torch.Tensor:
        """Each request's tokens at the start of its ``q`` slots, fillers after them."""
        draft_rows = step.draft_rows
        assert draft_rows is not None
        b = len(step.states)
        t = n * q
        starts = np.zeros(n, dtype=np.int64)
        starts[:b] = step.starts
        lens = starts + q
        positions = (starts[:, None] + np.arange(q, dtype=np.int64)[None, :]).reshape(-1)
        dest = draft_rows.row_request * q + draft_rows.row_offset
        host = torch.from_numpy(np.concatenate([positions, lens, dest]))
        device = self.runner.device
        packed = host.to(device, non_blocking=True) if device.type == "cuda" else host
        index = packed[t + n :]
        self.positions[:t].copy_(packed[:t])
        self.seq_lens[:n].copy_(packed[t : t + n])
        self.input_ids[:t].zero_()
        self.input_ids[index] = step.input_ids
        for slots, step_slots in zip(self.slot_mappings, step.slot_mappings, strict=True):
            slots[:t].fill_(-1)
            slots[index] = step_slots
        self.seq_rows[:b].copy_(step.seq_rows)
        if n > b:
            self.seq_rows[b:n].fill_(self.runner.batch.padding_row)
        replay, logits = self._graphs[n, q]
        replay()
        return logits[index]
