"""A draft model: a smaller checkpoint of the same vocabulary that proposes the drafts the
target verifies (``speculative_config.method == "draft_model"``).

It keeps its own KV cache, indexed by the same block ids as the target's (the engine core sizes
one block table for both). Each step:

1. **Catch-up**: it runs over the step's tokens exactly as the target does (same positions,
   slots and attention geometry), so its cache holds every position the target computed.
   Positions of rejected drafts hold garbage until a later step recomputes them, as in the
   target's cache; only positions before a request's next query are ever read.
2. **Drafting**, after verification, for the requests the engine asks: from the last known token at
   position ``n - 1`` it runs single-token passes, each writing that position's KV and proposing the
   next token. Drafts are sampled as the target samples (greedy for greedy requests; at
   temperature > 0 with the request's seeded noise at the drafted position, so a draft equals the
   target's sample whenever both distributions pick the same token of the same race; the drafts
   before it count in the penalties and ``min_tokens``). A pass writes KV only within the
   request's blocks: the engine reserves one slot per asked draft past the verified window
   (``SpecSupport.lookahead_per_draft``), and fewer drafts come back where fewer slots are there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core_cuda._attention import AttentionContext, KVCache
from engine_core_cuda._hf_config import ModelConfig, load_model_config
from engine_core_cuda._input_batch import CachedRequestState
from engine_core_cuda._loader import init_random_weights, load_weights
from engine_core_cuda._model import CausalLM
from engine_core_cuda._sampler import SamplingBatch, sample
from engine_core_cuda._sampling_inputs import build_sampling_batch
from engine_core_cuda._step_inputs import StepInputs, slots_of

if TYPE_CHECKING:
    from engine_core_cuda._cuda_graphs import DecodeGraphs
    from engine_core_cuda._model_runner import ModelRunner

__all__ = ["DraftModel"]


def load_draft_config(model_dir: str, target: ModelConfig) -> ModelConfig:
    """The draft's config; ``ValueError`` when its vocabulary differs from the target's."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"speculative_config.model: {model_dir!r} is not a directory")
    config = load_model_config(directory)
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model {model_dir} has a vocabulary of "
            f"{config.vocab_size} tokens, the target {target.vocab_size}; a draft model must "
            "share the target's vocabulary"
        )
    return config


class DraftModel:
    """The draft model of a :class:`~engine_core_cuda._model_runner.ModelRunner`."""

    def __init__(self, runner: ModelRunner, model_dir: str) -> None:
        self.runner = runner
        self.model_dir = model_dir
        self.model_config = load_draft_config(model_dir, runner.model_config)
        self.model = CausalLM(self.model_config, runner.max_model_len, runner.dtype, runner.device)
        self.load_weights()
        self.kv_caches: list[KVCache] = []
        self._kv_tensor: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        """Captured graphs of the draft (the backend sets them): its single-token passes, and
        catch-up passes of the target's decode and verification shapes."""

    def load_weights(self) -> None:
        if self.runner.options.load_format == "dummy":
            init_random_weights(self.model, self.runner.config.seed + 1)
        else:
            load_weights(self.model, Path(self.model_dir))

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of the draft."""
        c = self.model_config
        itemsize = self.runner.dtype.itemsize
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_size * itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.model_config
        shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_size)
        self._kv_tensor = torch.zeros(shape, dtype=self.runner.dtype, device=self.runner.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self._kv_tensor.unbind(0)]

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        self._kv_tensor = None

    def catch_up(self, step: StepInputs, ctx: AttentionContext) -> None:
        """Compute the draft's KV of the step's tokens (the target's attention geometry), in a
        captured graph when one fits the step (its logits go unused)."""
        if self.graphs is not None and self.graphs.can_run(step):
            self.graphs.run(step)
        else:
            self.model(step.input_ids, step.positions, self.kv_caches, ctx)

    def propose(self, states: list[CachedRequestState], num_drafts: int) -> list[list[int]]:
        """Up to ``num_drafts`` drafts continuing each of ``states`` (whose tokens are
        known up to ``num_tokens``), fewer where its blocks or ``max_model_len`` end first."""
        runner = self.runner
        batch = runner.batch
        block_size = batch.block_size
        limits = [
            max(0, min(num_drafts, s.num_blocks * block_size - s.num_tokens + 1,
                       batch.max_model_len - s.num_tokens))
            for s in states
        ]  # fmt: skip
        passes: list[tuple[list[int], torch.Tensor]] = []
        for i in range(max(limits, default=0)):
            active = [k for k, limit in enumerate(limits) if limit > i]
            tokens = self._draft_pass([states[k] for k in active], i, active, passes)
            passes.append((active, tokens))
        drafts: list[list[int]] = [[] for _ in states]
        if not passes:
            return drafts
        flat = torch.cat([tokens for _, tokens in passes]).tolist()  # one device->host copy
        at = 0
        for active, _ in passes:
            for k in active:
                drafts[k].append(flat[at])
                at += 1
        return drafts

    def _draft_pass(
        self,
        states: list[CachedRequestState],
        index: int,
        active: list[int],
        earlier: list[tuple[list[int], torch.Tensor]],
    ) -> torch.Tensor:
        """Pass ``index``: each request's token at ``num_tokens - 1 + index`` in, the next one
        out (written after it in the persistent row, for the next pass). ``active``: the
        requests' indices among those drafted; ``earlier``: the previous passes' (indices,
        drafts), which count as output for the penalties and ``min_tokens``."""
        runner = self.runner
        batch = runner.batch
        device = runner.device
        num = len(states)
        rows_host = np.fromiter((s.row for s in states), dtype=np.int64, count=num)
        positions_host = np.fromiter(
            (s.num_tokens - 1 + index for s in states), dtype=np.int64, count=num
        )
        host = torch.from_numpy(np.concatenate([rows_host, positions_host]))
        packed = host.to(device, non_blocking=True) if device.type == "cuda" else host
        rows, positions = packed[:num], packed[num:]
        step = StepInputs(
            states=states,
            starts=positions_host.tolist(),
            query_start_loc_host=np.arange(num + 1, dtype=np.int32),
            samples=[True] * num,
            num_tokens=num,
            max_query_len=1,
            input_ids=batch.token_ids[rows, positions].long(),
            positions=positions,
            slot_mappings=slots_of(batch, rows, positions),
            seq_rows=rows.to(torch.int32),
            query_start_loc=torch.arange(num + 1, dtype=torch.int32, device=device),
            seq_lens=(positions + 1).to(torch.int32),
        )
        if self.graphs is not None and self.graphs.can_run(step):
            logits = self.graphs.run(step)
        else:
            ctx = runner.context(step)
            hidden = self.model(step.input_ids, positions, self.kv_caches, ctx)
            logits = self.model.compute_logits(hidden)
        sampling = build_sampling_batch(batch, states, rows, positions + 1, None)
        if index:
            _count_earlier_drafts(sampling, states, index, active, earlier)
        tokens = sample(logits, sampling, runner.ops.impl)
        batch.token_ids[rows, positions + 1] = tokens.to(batch.token_ids.dtype)
        return tokens


def _count_earlier_drafts(
    sampling: SamplingBatch,
    states: list[CachedRequestState],
    index: int,
    active: list[int],
    earlier: list[tuple[list[int], torch.Tensor]],
) -> None:
    """Sample draft ``index`` as the target will verify it: the drafts before it count in the
    penalties, and stop tokens stay banned while the output there is below ``min_tokens``."""
    if sampling.output_counts is not None:
        device = sampling.output_counts.device
        local = torch.arange(len(active), device=device)
        counts = sampling.output_counts.clone()
        for previous, tokens in earlier:
            where = {k: j for j, k in enumerate(previous)}
            picked = torch.tensor([where[k] for k in active], dtype=torch.int64).to(device)
            ones = torch.ones(len(active), dtype=counts.dtype, device=device)
            counts.index_put_((local, tokens[picked]), ones, accumulate=True)
        sampling.output_counts = counts
    rows: list[int] = []
    banned: list[int] = []
    for j, state in enumerate(states):
        if state.stop_ids and state.num_output_tokens + index < state.params.min_tokens:
            rows.extend([j] * len(state.stop_ids))
            banned.extend(state.stop_ids)
    if not rows:
        sampling.banned = None
        return
    device = sampling.seeds.device
    packed = torch.tensor([rows, banned], dtype=torch.int64).to(device)
    sampling.banned = (packed[0], packed[1])
