"""KV-cache groups on the backend side, ahead of the engine core's: a Gemma 2 model (window,
full, window layers) whose full layer and window layers are two groups with block tables of
their own, driven by hand-made scheduler outputs that behave as a per-group KV-cache manager
would: a window group's blocks wholly behind the window are released while the request runs
(and overwritten with NaNs, as another request reusing them would overwrite them), a prefix
hit's window table holds null ids (-1) behind its window, groups never share a block id. The
tokens and logprobs equal transformers', so no layer read a released block or another group's
block."""

from __future__ import annotations

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._kv_layout import KVLayout, group_block_ids
from hf_reference import greedy, log_softmax
from tiny_models import WINDOW, TinyModel

from engine_core import SamplingParams
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig

BLOCK = 4
FULL, SLIDING = 0, 1
GROUPS = [[1], [0, 2]]  # Gemma 2's layers: window, full, window


class GroupedManager:
    """Block tables per group for a few requests, with window-group releases and refcounts."""

    def __init__(self, backend: CudaBackend, num_blocks: int) -> None:
        self.backend = backend
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_released = 0

    def _take(self) -> int:
        block = self.free.pop(0)
        self.refs[block] = 1
        return block

    def _grow(self, req_id: str, num_tokens: int) -> list[list[int]]:
        tables = self.tables[req_id]
        count = -(-num_tokens // BLOCK) - len(tables[FULL])
        fresh = [[self._take() for _ in range(count)] for _ in tables]
        for table, ids in zip(tables, fresh, strict=True):
            table += ids
        return fresh

    def release_behind_windows(self) -> None:
        """Drop each request's window blocks wholly before ``computed - WINDOW + 1`` (the first
        key its next query sees); a block nobody holds is poisoned."""
        kv = self.backend.runner._kv_tensor
        assert kv is not None
        for req_id, tables in self.tables.items():
            first_key = max(0, self.computed[req_id] - WINDOW + 1)
            table = tables[SLIDING]
            for b in range(first_key // BLOCK):
                block = table[b]
                if block < 0:
                    continue
                table[b] = -1
                self.refs[block] -= 1
                if self.refs[block] == 0:
                    kv[:, :, block] = float("nan")
                    self.free.append(block)
                    self.num_released += 1

    def add(self, req_id: str, prompt: list[int], chunk: int, hit_from: str | None = None,
            hit: int = 0) -> NewRequestData:  # fmt: skip
        """A new request whose first step computes ``chunk`` tokens; with ``hit_from``, its
        first ``hit`` tokens are a prefix hit on that request's blocks (full group: all of them;
        window group: those the window needs, -1 before)."""
        tables: list[list[int]] = [[], []]
        if hit_from is not None:
            source = self.tables[hit_from]
            tables[FULL] = source[FULL][: hit // BLOCK]
            first = max(0, hit - WINDOW + 1) // BLOCK
            tables[SLIDING] = [-1] * first + source[SLIDING][first : hit // BLOCK]
            assert all(b >= 0 for b in tables[SLIDING][first:]), "hit on a released block"
            for block in tables[FULL] + tables[SLIDING][first:]:
                self.refs[block] += 1
        self.tables[req_id] = [list(t) for t in tables]
        self.tokens[req_id] = list(prompt)
        self.computed[req_id] = hit
        num = min(chunk, len(prompt) - hit)
        self._grow(req_id, hit + num)
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        tables = [list(t) for t in self.tables[req_id]]
        return NewRequestData(req_id, prompt, params, tables, hit, num)  # type: ignore[arg-type]

    def step(self, new: list[NewRequestData], chunk: int) -> dict[str, torch.Tensor]:
        """One step: ``new`` requests' first chunks (their ``num_scheduled_tokens``), the running
        ones ``chunk`` more prompt tokens or one decode each; returns each sampled request's
        logits."""
        new_ids = {n.req_id for n in new}
        cached = CachedRequestData()
        for req_id, tokens in self.tokens.items():
            if req_id in new_ids:
                continue
            computed = self.computed[req_id]
            num = min(chunk, len(tokens) - computed)
            fresh = self._grow(req_id, computed + num)
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(fresh if fresh[FULL] else None)  # type: ignore[arg-type]
            cached.num_computed_tokens.append(computed)
            cached.num_scheduled_tokens.append(num)
        for n in new:
            self.computed[n.req_id] = n.num_computed_tokens
        total = sum(cached.num_scheduled_tokens) + sum(n.num_scheduled_tokens for n in new)
        self.backend.execute_model(SchedulerOutput(new, cached, total))
        forward = self.backend.runner._forward
        assert forward is not None and forward.logits is not None and forward.step is not None
        rows = {s.req_id: i for i, s in enumerate(forward.step.states)}
        logits = {r: forward.logits[rows[r]].clone() for r in rows}
        out = self.backend.sample_tokens(None)
        sampled = {}
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            scheduled = (cached.num_scheduled_tokens[cached.req_ids.index(req_id)]
                         if req_id in cached.req_ids else
                         next(n.num_scheduled_tokens for n in new if n.req_id == req_id))  # fmt: skip
            self.computed[req_id] += scheduled
            self.tokens[req_id] += tokens
            if tokens:
                sampled[req_id] = logits[req_id]
        self.release_behind_windows()
        return sampled


def test_group_block_ids_takes_one_table_or_one_per_group() -> None:
    assert group_block_ids([3, 4], 1) == [[3, 4]]
    assert group_block_ids(None, 2) == [[], []] and group_block_ids([], 1) == [[]]
    assert group_block_ids([[1, 2], [-1, 5]], 2) == [[1, 2], [-1, 5]]
    with pytest.raises(RuntimeError, match="one block table sent for a layout of 2"):
        group_block_ids([3, 4], 2)
    with pytest.raises(RuntimeError, match="3 block tables sent for a layout of 2"):
        group_block_ids([[1], [2], [3]], 2)
    with pytest.raises(RuntimeError, match=r"different lengths \[1, 2\]"):
        group_block_ids([[1], [2, 3]], 2)


def test_layouts_are_checked() -> None:
    assert KVLayout.of(GROUPS, 3).placement(3) == [(1, 0), (0, 0), (1, 1)]
    assert KVLayout.of(GROUPS, 3).num_slots == 2 and KVLayout.one_group(3).num_slots == 3
    with pytest.raises(ValueError, match=r"missing \[2\], repeated or out of range \[1\]"):
        KVLayout.of([[0, 1], [1]], 3)
    with pytest.raises(ValueError, match="every group needs a layer"):
        KVLayout.of([[0, 1, 2], []], 3)
    with pytest.raises(TypeError, match="layer indices must be ints"):
        KVLayout.of([[0, 1, "2"]], 3)  # type: ignore[list-item]


def test_two_groups_with_released_window_blocks_equal_transformers(
    tiny: dict[str, TinyModel],
) -> None:
    model = tiny["gemma2"]
    config = EngineConfig(model=str(model.path), backend="cuda", block_size=BLOCK,
                          max_model_len=128, backend_options={"device": "cpu"})  # fmt: skip
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(64, GROUPS)
        runner = backend.runner
        assert runner.kv_cache_shape[:3] == (2, 2, 64)  # two layers per page: groups padded
        assert [layer.self_attn.kv_group for layer in runner.model.model.layers] == [1, 0, 1]
        manager = GroupedManager(backend, 64)
        prompt_a = [(7 * i + 3) % 300 + 2 for i in range(30)]
        prompt_b = prompt_a[:28] + [11, 12, 13]
        logits: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

        def record(sampled: dict[str, torch.Tensor]) -> None:
            for req_id, row in sampled.items():
                logits[req_id].append(row)

        record(manager.step([manager.add("a", prompt_a, 6)], chunk=6))  # chunked prefill of a
        for _ in range(4):
            record(manager.step([], chunk=6))
        record(manager.step([manager.add("b", prompt_b, 6, hit_from="a", hit=28)], chunk=6))
        for _ in range(8):
            record(manager.step([], chunk=6))
        assert manager.num_released >= 6  # blocks behind the window were released and poisoned
        b_table = runner.batch.block_tables[SLIDING][runner.batch.requests["b"].row]
        assert b_table[:5].tolist() == [-1] * 5  # the hit's null ids behind its window
    finally:
        backend.close()
    for req_id, prompt in (("a", prompt_a), ("b", prompt_b)):
        output = manager.tokens[req_id][len(prompt) :]
        assert output == greedy(model.hf, prompt, len(output)), req_id
        expected = log_softmax(model.hf, manager.tokens[req_id])
        for i, row in enumerate(logits[req_id]):
            got = row.log_softmax(-1)
            torch.testing.assert_close(got, expected[len(prompt) - 1 + i], atol=1e-4, rtol=0)
