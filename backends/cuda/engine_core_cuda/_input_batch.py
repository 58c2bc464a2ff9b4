"""Per-request state that persists on the device between steps.

Each live request owns a row of the persistent tensors: its tokens (prompt, then every sampled
token, written on the device by the sampler), its block table in each KV-cache group
(:mod:`engine_core_cuda._kv_layout`; one group unless the engine core sends more), its sampling
parameters and, when
it uses penalties, its output-token counts and prompt-token mask. A new request is sent to the
device once; after that a step only transfers what changed (new block ids) plus a few integers
per scheduled request, however long the requests' contexts are.

Writes are staged on the host and flushed as one scatter per tensor at the start of a step.
The host keeps a small :class:`CachedRequestState` per request (counters, no token lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core.abc import NewRequestData, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from engine_core_cuda._kv_layout import group_block_ids
from engine_core_cuda._random import request_seed

__all__ = ["InputBatch", "CachedRequestState"]

# Columns of InputBatch.float_params.
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
# Columns of InputBatch.int_params.
TOP_K, SEED = range(2)


@dataclass(slots=True, eq=False)
class CachedRequestState:
    """What the host tracks of a live request."""

    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    """Tokens known: the prompt, then the outputs."""
    num_computed_tokens: int
    num_blocks: int
    """Entries of its block table (the same in every KV-cache group)."""
    params: SamplingParams
    stop_ids: tuple[int, ...]
    """EOS and stop token ids, masked while fewer than ``min_tokens`` outputs exist."""
    greedy: bool
    uses_penalties: bool
    num_prompt_logprobs: int | None
    """Asked prompt logprobs (None: none, or a request resumed after they were delivered)."""
    constrained: bool
    pending_prompt_logprobs: TokenLogprobs | None = None
    """The prompt-logprobs entry of the next chunk's first position, computed with this
    chunk's last logits."""
    drafts: list[int] = field(default_factory=list)
    """Speculative decoding: the draft tokens this step verifies after the last known token
    (written at positions ``num_tokens ..``; empty: none)."""

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


class _Scatter:
    """Staged ``tensor[rows, cols] = values`` writes, flushed as one indexed store."""

    __slots__ = ("rows", "cols", "values")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.values: list[int] = []

    def add(self, row: int, start: int, values: list[int]) -> None:
        n = len(values)
        self.rows.extend([row] * n)
        self.cols.extend(range(start, start + n))
        self.values.extend(values)

    def flush(self, target: torch.Tensor) -> None:
        if not self.rows:
            return
        packed = torch.tensor([self.rows, self.cols, self.values], dtype=torch.int64)
        packed = packed.to(target.device, non_blocking=True)
        target[packed[0], packed[1]] = packed[2].to(target.dtype)
        self.rows, self.cols, self.values = [], [], []


class InputBatch:
    """The persistent rows of up to ``max_num_reqs`` live requests."""

    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        engine_seed: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.engine_seed = engine_seed
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32, device=device)
        self.requests: dict[str, CachedRequestState] = {}
        self.block_tables: list[torch.Tensor] = []
        self._block_writes: list[_Scatter] = []
        self.set_kv_groups(1)
        self.float_params = torch.zeros(max_num_reqs, 6, dtype=torch.float32, device=device)
        self.int_params = torch.zeros(max_num_reqs, 2, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._token_writes = _Scatter()
        self._param_rows: list[int] = []
        self._float_values: list[list[float]] = []
        self._int_values: list[list[int]] = []

    def set_kv_groups(self, num_groups: int) -> None:
        """One block table per KV-cache group (their entries zeroed); no request may be live."""
        if self.requests:
            raise RuntimeError("the KV-cache groups changed while requests are live")
        # One extra all-zero row: the table row of padding sequences (CUDA-graph batches).
        shape = (self.max_num_reqs + 1, self.max_blocks)
        self.block_tables = [
            torch.zeros(shape, dtype=torch.int32, device=self.device) for _ in range(num_groups)
        ]
        self._block_writes = [_Scatter() for _ in range(num_groups)]

    @property
    def num_kv_groups(self) -> int:
        return len(self.block_tables)

    @property
    def block_table(self) -> torch.Tensor:
        """The block table of KV-cache group 0 (the only one unless the core sends groups)."""
        return self.block_tables[0]

    @property
    def padding_row(self) -> int:
        """The block-table row of padding sequences (all zeros)."""
        return self.max_num_reqs

    def add(self, new: NewRequestData) -> CachedRequestState:
        """Give ``new`` a row and stage its tokens, block table and parameters."""
        if not self._free_rows:
            raise RuntimeError(
                f"more than max_num_seqs={self.max_num_reqs} requests are live in the backend"
            )
        tokens = new.prompt_token_ids + new.output_token_ids
        if len(tokens) > self.max_model_len:
            raise RuntimeError(
                f"request {new.req_id!r} has {len(tokens)} tokens; max_model_len is "
                f"{self.max_model_len}"
            )
        block_ids = group_block_ids(new.block_ids, self.num_kv_groups)
        num_blocks = len(block_ids[0])
        if num_blocks > self.max_blocks:
            raise RuntimeError(
                f"request {new.req_id!r} has {num_blocks} blocks; at most "
                f"{self.max_blocks} fit max_model_len"
            )
        params = new.sampling_params
        row = self._free_rows.pop()
        state = CachedRequestState(
            req_id=new.req_id,
            row=row,
            num_prompt_tokens=len(new.prompt_token_ids),
            num_tokens=len(tokens),
            num_computed_tokens=new.num_computed_tokens,
            num_blocks=num_blocks,
            params=params,
            stop_ids=tuple(dict.fromkeys([*new.eos_token_ids, *(params.stop_token_ids or ())])),
            greedy=params.is_greedy,
            uses_penalties=_uses_penalties(params),
            # A resumed request delivered its prompt logprobs before it was preempted.
            num_prompt_logprobs=None if new.output_token_ids else params.prompt_logprobs,
            constrained=params.structured_outputs is not None,
        )
        self.requests[new.req_id] = state
        self._token_writes.add(row, 0, tokens)
        for writes, ids in zip(self._block_writes, block_ids, strict=True):
            writes.add(row, 0, ids)
        self._param_rows.append(row)
        self._float_values.append(
            [
                1.0 if params.is_greedy else params.temperature,
                params.top_p,
                params.min_p,
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
            ]
        )
        top_k = params.top_k if params.top_k > 0 else self.vocab_size
        seed = request_seed(new.req_id, params.seed, self.engine_seed)
        self._int_values.append([top_k, seed])
        if state.uses_penalties:
            self._init_penalty_row(row, new)
        return state

    def _init_penalty_row(self, row: int, new: NewRequestData) -> None:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        prompt = torch.tensor(new.prompt_token_ids, dtype=torch.int64).to(self.device)
        self.prompt_mask[row, prompt] = True
        if new.output_token_ids:
            outputs = torch.tensor(new.output_token_ids, dtype=torch.int64).to(self.device)
            self.output_counts[row].index_add_(
                0, outputs, torch.ones_like(outputs, dtype=torch.int32)
            )

    def remove(self, req_id: str) -> None:
        """Free the row of ``req_id`` (unknown ids are ignored)."""
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def append_blocks(self, state: CachedRequestState, block_ids: list[list[int]]) -> None:
        """Stage blocks appended to a request's block table in each group (``block_ids[g]``,
        of one length: :func:`~engine_core_cuda._kv_layout.group_block_ids`)."""
        added = len(block_ids[0])
        if state.num_blocks + added > self.max_blocks:
            raise RuntimeError(
                f"request {state.req_id!r} would have {state.num_blocks + added} "
                f"blocks; at most {self.max_blocks} fit max_model_len"
            )
        for writes, ids in zip(self._block_writes, block_ids, strict=True):
            writes.add(state.row, state.num_blocks, ids)
        state.num_blocks += added

    def stage_tokens(self, state: CachedRequestState, start: int, token_ids: list[int]) -> None:
        """Stage ``token_ids`` at positions ``start ..`` of a request's row."""
        self._token_writes.add(state.row, start, token_ids)

    def flush(self) -> None:
        """Send the staged writes to the device."""
        self._token_writes.flush(self.token_ids)
        for writes, table in zip(self._block_writes, self.block_tables, strict=True):
            writes.flush(table)
        if self._param_rows:
            rows = torch.tensor(self._param_rows, dtype=torch.int64).to(self.device)
            floats = torch.tensor(self._float_values, dtype=torch.float32)
            self.float_params[rows] = floats.to(self.device, non_blocking=True)
            ints = torch.tensor(self._int_values, dtype=torch.int64)
            self.int_params[rows] = ints.to(self.device, non_blocking=True)
            self._param_rows, self._float_values, self._int_values = [], [], []

    def record_sampled(
        self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Write sampled ``tokens`` at ``positions`` of ``rows`` (device tensors) and count them
        for the penalties."""
        self.token_ids[rows, positions] = tokens.to(torch.int32)
        if self.output_counts is not None:
            self.output_counts.index_put_(
                (rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
            )

    def clear_device_state(self) -> None:
        """Forget every request (their rows become free)."""
        self.requests.clear()
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))
