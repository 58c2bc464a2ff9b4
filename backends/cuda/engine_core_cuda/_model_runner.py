"""``ModelRunner``: the model, its paged KV cache and the persistent batch, stepped together.

``execute_model`` applies the scheduler's diffs, runs the forward pass (through a CUDA graph for
decode batches when captured) and keeps the last position's logits of every request;
``sample_tokens`` samples on the device, writes the tokens back into the persistent batch and
returns them. No host synchronization happens between the two, so the forward pass runs while
the engine core computes the grammar bitmask.

With speculative decoding a request may carry drafts: they are written after its last known
token, the logits cover its ``1 + drafts`` last positions, and ``sample_tokens`` verifies them
(:mod:`engine_core_cuda._spec_step`); a draft model (:mod:`engine_core_cuda._draft_model`)
catches up on each step's tokens and proposes the next step's drafts after sampling.

Under async scheduling ``sample_tokens_async`` launches the sampling and returns at once: the
tokens are written into the persistent rows on the device (the next step's input ids are
gathered from there, so they never go through the host) and copied to pinned host memory with a
non-blocking copy and an event; the handle waits on that event only when the core asks for the
step's results, after it has launched the next step. Steps asking for logprobs or prompt
logprobs are sampled synchronously and handed back as a ready handle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine_core.abc import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from engine_core.config import EngineConfig
from engine_core_cuda._attention import AttentionContext, KVCache, split_kv_segments
from engine_core_cuda._device import (
    CpuThreads,
    apply_cpu_threads,
    prepare_triton,
    resolve_cpu_threads,
    resolve_device,
    resolve_dtype,
)
from engine_core_cuda._draft_model import DraftModel
from engine_core_cuda._fp8 import prepare_fp8_storage, resolve_kv_cache_dtype
from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._input_batch import InputBatch
from engine_core_cuda._kernel_ops import KernelOps
from engine_core_cuda._kv_layout import KVLayout
from engine_core_cuda._layers import Attention
from engine_core_cuda._loader import init_random_weights, load_weights
from engine_core_cuda._logprobs import prompt_logprobs, to_token_logprobs
from engine_core_cuda._lora import LoRAModel
from engine_core_cuda._model import CausalLM
from engine_core_cuda._options import CudaOptions
from engine_core_cuda._sampler import compute_logprobs, sample
from engine_core_cuda._sampling_inputs import build_sampling_batch
from engine_core_cuda._spec_step import receive_verified, sample_with_drafts
from engine_core_cuda._step_inputs import StepInputs, apply_scheduler_output, build_step_inputs

if TYPE_CHECKING:
    from engine_core_cuda._cuda_graphs import DecodeGraphs
    from engine_core_cuda._tp.parallel import TensorParallel
    from engine_core_cuda._tp.shard import Slice

__all__ = ["AsyncSampled", "ModelRunner"]


def _gathered(logits: torch.Tensor) -> torch.Tensor:
    """Under tensor parallelism the prompt rows were turned into logits in ``execute_model``."""
    return logits


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Forward:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    req_ids: list[str]
    step: StepInputs | None
    logits: torch.Tensor | None
    """``[requests, vocab]`` float32 logits of each request's last scheduled position; with
    drafts, of each request's ``1 + drafts`` last positions (``step.draft_rows``)."""
    hidden: torch.Tensor | None
    """Every token's final hidden state, kept only when prompt logprobs are due."""
    num_draft_tokens: int = 0
    """Drafts the draft model proposes after sampling (``SchedulerOutput.num_draft_tokens``)."""
    draft_req_ids: list[str] | None = None


class AsyncSampled(AsyncModelRunnerOutput):
    """A launched step's sampled tokens on their way to pinned host memory."""

    __slots__ = ("_req_ids", "_picks", "_host", "_events", "_ready", "device_time_s")

    def __init__(
        self,
        req_ids: list[str],
        picks: list[int],
        host: torch.Tensor | None,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None,
        ready: ModelRunnerOutput | None = None,
    ) -> None:
        self._req_ids = req_ids
        self._picks = picks
        self._host = host
        self._events = events
        """(step start, results copied): timing events on the device's stream."""
        self._ready = ready
        self.device_time_s: float | None = None

    @classmethod
    def done(
        cls, output: ModelRunnerOutput, events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    ) -> AsyncSampled:
        """A handle whose results are already on the host."""
        return cls(output.req_ids, [], None, events, output)

    def ready(self) -> bool:
        """Whether ``get_output`` would return without waiting."""
        return self._events is None or self._events[1].query()

    def get_output(self) -> ModelRunnerOutput:
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self.device_time_s = start.elapsed_time(end) / 1e3
        if self._ready is not None:
            return self._ready
        sampled: list[list[int]] = [[] for _ in self._req_ids]
        if self._host is not None:
            for i, token in zip(self._picks, self._host.tolist(), strict=True):
                sampled[i] = [token]
        return ModelRunnerOutput(self._req_ids, sampled)


class ModelRunner:
    """Runs one model on one device for the :class:`~engine_core_cuda.CudaBackend`."""

    def __init__(
        self,
        config: EngineConfig,
        options: CudaOptions,
        model_config: ModelConfig,
        parallel: TensorParallel | None = None,
    ) -> None:
        self.config = config
        self.options = options
        self.full_model_config = model_config
        self.parallel = parallel
        if parallel is not None:
            from engine_core_cuda._tp.shard import shard_model_config

            model_config = shard_model_config(model_config, parallel.size)
        self.model_config = model_config
        """This rank's geometry (heads, KV heads and intermediate size of its shard)."""
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        """The KV cache's element type: the model's, or FP8 (``kv_cache_dtype="fp8"``)."""
        self.cpu_threads: CpuThreads | None = None
        """torch's intra-op threads on the CPU (None on a GPU), set again on the thread of each
        step (the engine may step on another thread than the one that built the runner)."""
        if self.device.type == "cpu":
            self.cpu_threads = resolve_cpu_threads(options.cpu_threads, config.tensor_parallel_size)
            apply_cpu_threads(self.cpu_threads.threads)
        if options.kernels == "triton":
            prepare_triton(self.device)
        self.ops = KernelOps(options.kernels)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or model_config.max_model_len
        self.model = CausalLM(model_config, self.max_model_len, self.dtype, self.device, parallel)
        self.quantization = model_config.quantization
        if self.quantization is not None:  # FP8 weights, filled by the loader
            prepare_fp8_storage(self.model, self.quantization.ignore)
        self.drafter: DraftModel | None = None
        self.load_weights()
        self.lora: LoRAModel | None = None
        """Multi-LoRA (``EngineConfig.enable_lora``): the adapters and their device slots."""
        if config.enable_lora:
            self.lora = self._make_lora()
        self.batch = InputBatch(
            max_num_reqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            vocab_size=model_config.vocab_size,
            engine_seed=config.seed,
            device=self.device,
        )
        self.num_blocks = 0
        self.kv_layout = KVLayout.one_group(model_config.num_layers)
        self.kv_caches: list[KVCache] = []
        self._kv_tensor: torch.Tensor | None = None
        self._forward: _Forward | None = None
        self._step_start: torch.cuda.Event | None = None
        """Timing event recorded where the last step's forward pass starts (CUDA only)."""
        self.graphs: DecodeGraphs | None = None
        spec = config.speculative_config
        # Under tensor parallelism the draft model runs whole on rank 0, which proposes: its
        # passes take no collective, and the other ranks only verify what rank 0 sends.
        on_rank0 = parallel is None or parallel.rank == 0
        if (
            spec is not None
            and spec.method == "draft_model"
            and spec.model is not None
            and on_rank0
        ):
            self.drafter = DraftModel(self, spec.model)
        self._spans = sorted(
            {span for i in range(model_config.num_layers)
             if (span := model_config.layer_attention(i).span) is not None}
        )  # fmt: skip
        self._sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 0
        )

    # -- weights and KV cache -------------------------------------------------------------------

    def load_weights(self) -> None:
        """Fill the model from the checkpoint (or with random weights for ``load_format`` dummy)."""
        model_dir = self.config.model
        if model_dir is None:
            raise ValueError("the cuda backend needs a model directory (EngineConfig.model)")
        if self.options.load_format == "dummy":
            init_random_weights(self.model, self.config.seed)
        elif self.parallel is None:
            load_weights(self.model, Path(model_dir), quant=self.quantization)
        else:
            from engine_core_cuda._tp.shard import slice_of

            full, rank, size = self.full_model_config, self.parallel.rank, self.parallel.size
            load_weights(
                self.model,
                Path(model_dir),
                lambda name, ndim: slice_of(name, ndim, full, rank, size),
                self.quantization,
            )
        if self.drafter is not None:
            self.drafter.load_weights()
        if self.device.type == "cpu":
            from engine_core_cuda._layers import pack_cpu_linears

            pack_cpu_linears(self.modules(), max(1, min(self.config.max_num_seqs, 64)))

    def _make_lora(self) -> LoRAModel:
        slicer = None
        if self.parallel is not None:
            from engine_core_cuda._tp.shard import slice_of

            full, rank, size = self.full_model_config, self.parallel.rank, self.parallel.size

            def slicer(name: str, ndim: int) -> Slice | None:
                return slice_of(name, ndim, full, rank, size)

        config = self.config
        max_tokens = max(config.max_num_batched_tokens or 8192, config.max_num_seqs)
        return LoRAModel(
            self.model, self.full_model_config, config.max_loras, config.max_lora_rank,
            max_tokens, self.options.kernels, self.dtype, self.device, slicer,
        )  # fmt: skip

    def modules(self) -> list[torch.nn.Module]:
        """The model and the draft model (if any)."""
        roots: list[torch.nn.Module] = [self.model]
        if self.drafter is not None:
            roots.append(self.drafter.model)
        return roots

    def parameters(self) -> list[torch.nn.Parameter]:
        """The weights of the model and of the draft model (if any)."""
        params = list(self.model.parameters())
        if self.drafter is not None:
            params += self.drafter.model.parameters()
        return params

    @property
    def kv_cache_shape(self) -> tuple[int, ...]:
        """``[slots, 2, blocks, block_size, kv_heads, head_size]`` of the one KV tensor (slots:
        layers per page, :class:`~engine_core_cuda._kv_layout.KVLayout`)."""
        c = self.model_config
        slots = self.kv_layout.num_slots
        return (slots, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_size)

    def allocate_kv_cache(self, num_blocks: int, layout: KVLayout | None = None) -> None:
        """Allocate one tensor for every layer's keys and values, and its per-layer views:
        ``layout`` places the layers in KV-cache groups (default: one group of every layer).
        Each layer then writes and reads through its group's block table."""
        self.release_kv_cache()
        num_layers = self.model_config.num_layers
        if layout is not None and layout != self.kv_layout:
            self.batch.set_kv_groups(layout.num_groups)
            self.kv_layout = layout
        self.num_blocks = num_blocks
        self._kv_tensor = torch.zeros(self.kv_cache_shape, dtype=self.kv_dtype, device=self.device)
        slots = self._kv_tensor.unbind(0)
        self.kv_caches = []
        for layer, (group, slot) in zip(
            self.model.model.layers, self.kv_layout.placement(num_layers), strict=True
        ):
            attention = layer.self_attn
            assert isinstance(attention, Attention)
            attention.kv_group = group
            self.kv_caches.append((slots[slot][0], slots[slot][1]))
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, self.block_size)

    @property
    def kv_tensor(self) -> torch.Tensor | None:
        """The one KV tensor (``kv_cache_shape``; None before ``allocate_kv_cache``)."""
        return self._kv_tensor

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        self._kv_tensor = None
        if self.drafter is not None:
            self.drafter.release_kv_cache()

    # -- stepping -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._forward is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        if self._kv_tensor is None:
            raise RuntimeError("execute_model called without a KV cache (initialize_kv_cache)")
        if self.cpu_threads is not None:
            apply_cpu_threads(self.cpu_threads.threads)
        if self.device.type == "cuda":
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        if self.lora is not None:
            self.lora.track(
                ((new.req_id, new.lora_int_id) for new in scheduler_output.new_reqs),
                scheduler_output.finished_req_ids,
            )
        states, starts, counts = apply_scheduler_output(self.batch, scheduler_output)
        total = sum(counts)
        if total != scheduler_output.total_num_scheduled_tokens:
            raise RuntimeError(
                f"total_num_scheduled_tokens is {scheduler_output.total_num_scheduled_tokens} "
                f"but the batch schedules {total} tokens"
            )
        self.batch.flush()
        req_ids = scheduler_output.req_ids
        if not states:
            self._forward = _Forward(req_ids, None, None, None)
            return
        step = build_step_inputs(self.batch, states, starts, counts)
        wants_prompt = any(
            s.num_prompt_logprobs is not None and start < s.num_prompt_tokens
            for s, start in zip(states, starts, strict=True)
        )
        lora_ids = None
        if self.lora is not None:
            lora_ids = [self.lora.request_lora.get(s.req_id, 0) for s in states]
        if self.graphs is not None and self.graphs.can_run(step) and not wants_prompt:
            logits = self.graphs.run(step, lora_ids, scheduler_output.lora_ids)
            hidden = None
        else:
            if self.lora is not None and lora_ids is not None:
                self.lora.prepare(
                    lora_ids, step.query_start_loc_host.tolist(), scheduler_output.lora_ids
                )
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, self.context(step))
            last = step.logits_indices
            if last is None:
                last = step.query_start_loc[1:].long() - 1
            logits = self.model.compute_logits(hidden[last])
            if wants_prompt and self.parallel is not None:
                # Every rank joins this gather now; sample_tokens (rank 0 only) reads the rows.
                hidden = self.model.compute_logits(hidden)
        if self.drafter is not None:
            self.drafter.catch_up(step, self.context(step))
        self._forward = _Forward(
            req_ids, step, logits, hidden if wants_prompt else None,
            scheduler_output.num_draft_tokens, scheduler_output.draft_req_ids,
        )  # fmt: skip

    def context(self, step: StepInputs) -> AttentionContext:
        """The attention context of a step run outside CUDA graphs."""
        num_seqs, max_len = len(step.states), max(step.starts) + step.max_query_len
        return AttentionContext(
            ops=self.ops,
            slot_mappings=step.slot_mappings,
            block_tables=tuple(self.batch.block_tables),
            seq_rows=step.seq_rows,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            max_query_len=step.max_query_len,
            num_segments=self.num_segments(num_seqs, step.max_query_len, max_len),
            span_segments=self.span_segments(num_seqs, step.max_query_len, max_len),
        )

    def num_segments(self, num_seqs: int, max_query_len: int, max_seq_len: int) -> int:
        """Split-KV segments: only for decode batches too small to fill the GPU, more for
        longer sequences (:func:`~engine_core_cuda._attention.split_kv_segments`)."""
        return split_kv_segments(num_seqs, self.model_config.num_kv_heads, self._sm_count,
                                 max_seq_len, max_query_len)  # fmt: skip

    def span_segments(self, num_seqs: int, max_query_len: int, max_seq_len: int) -> dict[int, int]:
        """Split-KV segments of the window and chunk layers, by the most keys a query of theirs
        sees: as :meth:`num_segments` for the keys a query of the longest sequence reads."""
        return {
            span: self.num_segments(num_seqs, max_query_len,
                                    min(max_seq_len, span + max_query_len - 1))
            for span in self._spans
        }  # fmt: skip

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        forward = self._forward
        if forward is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        self._forward = None
        step = forward.step
        if step is None or forward.logits is None:
            return ModelRunnerOutput(forward.req_ids, [[] for _ in forward.req_ids])
        states = step.states
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] | None = None
        picks = [i for i, s in enumerate(step.samples) if s]
        if picks and step.draft_rows is not None:
            broadcast = self.parallel.broadcast if self.parallel is not None else None
            sampled, logprobs = sample_with_drafts(
                self.batch, step, forward.logits, picks, grammar_bitmask, self.ops.impl, broadcast
            )
        elif picks:
            tokens = self._sample(step, forward.logits, picks, grammar_bitmask)
            token_list = tokens.tolist()
            for i, token in zip(picks, token_list, strict=True):
                sampled[i] = [token]
                states[i].num_tokens += 1
            logprobs = self._sample_logprobs(step, forward.logits, picks, tokens, token_list)
        prompt = None
        if forward.hidden is not None:
            offsets = step.query_start_loc_host.tolist()
            entries = [
                (s, start, offsets[i + 1] - offsets[i], offsets[i])
                for i, (s, start) in enumerate(zip(states, step.starts, strict=True))
                if s.num_prompt_logprobs is not None and start < s.num_prompt_tokens
            ]
            score = self.model.compute_logits if self.parallel is None else _gathered
            prompt = prompt_logprobs(self.batch, forward.hidden, score, entries)
        drafts = self._propose(forward, picks) if self.drafter is not None else None
        return ModelRunnerOutput(forward.req_ids, sampled, logprobs, prompt, drafts)

    def _propose(self, forward: _Forward, picks: list[int]) -> list[list[int]] | None:
        """The draft model's drafts for the next step of the requests the engine asked."""
        assert self.drafter is not None and forward.step is not None
        if forward.num_draft_tokens <= 0:
            return None
        states = forward.step.states
        wanted = set(forward.draft_req_ids) if forward.draft_req_ids is not None else None
        chosen = [i for i in picks if wanted is None or states[i].req_id in wanted]
        drafts: list[list[int]] = [[] for _ in states]
        proposed = self.drafter.propose([states[i] for i in chosen], forward.num_draft_tokens)
        for i, proposal in zip(chosen, proposed, strict=True):
            drafts[i] = proposal
        return drafts

    def sample_tokens_async(self, grammar_bitmask: Any | None) -> AsyncSampled:
        """Launch sampling; the handle's ``get_output`` waits for the tokens (see the module
        docs)."""
        forward = self._forward
        if forward is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        step = forward.step
        if (
            step is None
            or forward.logits is None
            or forward.hidden is not None
            or step.draft_rows is not None
            or any(s.params.logprobs is not None for s in step.states)
        ):
            output = self.sample_tokens(grammar_bitmask)
            return AsyncSampled.done(output, self._step_events())
        self._forward = None
        picks = [i for i, s in enumerate(step.samples) if s]
        if not picks:
            return AsyncSampled(forward.req_ids, [], None, self._step_events())
        tokens = self._sample(step, forward.logits, picks, grammar_bitmask)
        for i in picks:
            step.states[i].num_tokens += 1
        if self.device.type != "cuda":
            return AsyncSampled(forward.req_ids, picks, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        return AsyncSampled(forward.req_ids, picks, host, self._step_events())

    def _step_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The last step's start event and one recorded now, after its work (CUDA only)."""
        start = self._step_start
        if start is None or self.device.type != "cuda":
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._step_start = None
        return start, end

    def _sample(
        self, step: StepInputs, logits: torch.Tensor, picks: list[int], bitmask: Any | None
    ) -> torch.Tensor:
        if self.cpu_threads is not None:
            apply_cpu_threads(self.cpu_threads.threads)
        all_pick = len(picks) == len(step.states)
        index = None if all_pick else torch.tensor(picks, dtype=torch.int64).to(self.device)
        rows = step.seq_rows.long() if index is None else step.seq_rows[index].long()
        positions = step.seq_lens.long() if index is None else step.seq_lens[index].long()
        picked_logits = logits if index is None else logits[index]
        picked = [step.states[i] for i in picks]
        batch = build_sampling_batch(
            self.batch, picked, rows, positions, self._bitmask_rows(step, picks, bitmask)
        )
        tokens = sample(picked_logits, batch, self.ops.impl)
        if self.parallel is not None:
            self.parallel.broadcast(tokens)  # the other ranks' next input ids (receive_tokens)
        self.batch.record_sampled(rows, positions, tokens)
        return tokens

    def _bitmask_rows(
        self, step: StepInputs, picks: list[int], bitmask: Any | None
    ) -> tuple[list[int], torch.Tensor] | None:
        """(indices among the picked rows, their bitmask rows on the device). Bitmask rows follow
        the batch's constrained requests; rows of requests on a partial prefill chunk may be
        present or left out."""
        if bitmask is None:
            return None
        states = step.states
        constrained = [i for i, s in enumerate(states) if s.constrained]
        words = np.asarray(bitmask, dtype=np.int32)
        if words.ndim != 2:
            raise RuntimeError(f"grammar bitmask must be 2-D, got shape {words.shape}")
        if len(words) != len(constrained):
            constrained = [i for i in constrained if step.samples[i]]
            if len(words) != len(constrained):
                raise RuntimeError(
                    f"grammar bitmask has {len(words)} rows but the batch has "
                    f"{len(constrained)} constrained requests to sample"
                )
        position = {batch_index: k for k, batch_index in enumerate(picks)}
        chosen = [(position[i], row) for row, i in enumerate(constrained) if i in position]
        if not chosen:
            return None
        selected = words[[row for _, row in chosen]]
        return [k for k, _ in chosen], torch.from_numpy(selected).to(self.device)

    def _sample_logprobs(
        self,
        step: StepInputs,
        logits: torch.Tensor,
        picks: list[int],
        tokens: torch.Tensor,
        token_list: list[int],
    ) -> list[list[TokenLogprobs] | None] | None:
        asked = [k for k, i in enumerate(picks) if step.states[i].params.logprobs is not None]
        if not asked:
            return None
        num_tops = [step.states[picks[k]].params.logprobs or 0 for k in asked]
        index = torch.tensor([picks[k] for k in asked], dtype=torch.int64).to(self.device)
        token_index = torch.tensor(asked, dtype=torch.int64).to(self.device)
        tensors = compute_logprobs(logits[index], tokens[token_index], max(num_tops))
        entries = to_token_logprobs(tensors, [token_list[k] for k in asked], num_tops)
        result: list[list[TokenLogprobs] | None] = [None] * len(step.states)
        for k, entry in zip(asked, entries, strict=True):
            result[picks[k]] = [entry]
        return result

    # -- tensor-parallel workers ----------------------------------------------------------------

    def skip_sampling(self) -> StepInputs | None:
        """End a step without sampling (ranks other than 0): the step, for
        :meth:`receive_tokens`."""
        forward, self._forward = self._forward, None
        return forward.step if forward is not None else None

    def receive_tokens(self, step: StepInputs) -> None:
        """Take the ids rank 0 sampled in ``step`` from its broadcast (issued in :meth:`_sample`
        on rank 0, in the same order on every rank) and write them into the batch, as
        :meth:`_sample` does on rank 0: the next step gathers its input ids from there."""
        picks = [i for i, s in enumerate(step.samples) if s]
        if not picks:
            return  # rank 0 sampled nothing, hence broadcast nothing
        assert self.parallel is not None
        if step.draft_rows is not None:  # rank 0 verified drafts (sample_with_drafts)
            receive_verified(self.batch, step, picks, self.parallel.broadcast)
            return
        tokens = torch.empty(len(picks), dtype=torch.int64, device=self.device)
        self.parallel.broadcast(tokens)
        index = torch.tensor(picks, dtype=torch.int64).to(self.device)
        self.batch.record_sampled(step.seq_rows[index].long(), step.seq_lens[index].long(), tokens)
        for i in picks:
            step.states[i].num_tokens += 1

    # -- lifecycle ------------------------------------------------------------------------------

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they point at the KV cache)."""
        self.graphs = None
        if self.drafter is not None:
            self.drafter.graphs = None

    def drop_requests(self) -> None:
        """Forget every request (their KV contents are gone)."""
        self.batch.clear_device_state()
        self._forward = None
