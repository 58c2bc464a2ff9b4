"""The engine core's KV-cache groups driving the CUDA backend on the CPU: Gemma 3 (five window
layers per full one), Mistral (a window on every layer) and gpt-oss (window and full layers
alternating, with sinks) report per-layer specs, the core
groups them and releases the window groups' blocks behind the window while requests run (the
freed blocks go to other requests), and greedy tokens still equal transformers'."""

from __future__ import annotations

import pytest
from hf_reference import PROMPTS, greedy
from tiny_models import WINDOW, TinyModel

from engine_core import SamplingParams
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._core.kv_cache_manager import NULL_BLOCK
from engine_core._engine.core import EngineCore
from engine_core.abc import SlidingWindowSpec, load_tokenizer
from engine_core.config import EngineConfig


@pytest.mark.parametrize("kind", ["gemma3", "mistral", "gpt_oss"])
def test_window_groups_release_blocks_and_tokens_match_transformers(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    model = tiny[kind]
    core = EngineCore(
        EngineConfig(
            model=str(model.path),
            backend="cuda",
            backend_options={"device": "cpu", "kernels": "torch"},
            block_size=4,
            max_model_len=256,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            num_kv_blocks=160,
        )
    )
    try:
        specs = core.backend.kv_cache_spec()
        assert isinstance(specs, list)
        assert any(isinstance(s, SlidingWindowSpec) and s.window == WINDOW for s in specs)
        assert any(g.span == WINDOW for g in core.kv_layout.groups)
        tokenizer = load_tokenizer(str(model.path))
        encoded = [tokenizer.encode(p) for p in PROMPTS]
        prompts = {f"r{i}": p for i, p in enumerate(encoded) if len(p) > 2 * WINDOW}
        assert len(prompts) >= 2 and any(len(p) > 3 * WINDOW for p in prompts.values())
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        released = 0
        for req_id, ids in prompts.items():
            tokens[req_id] = []
            core.add_request(EngineCoreRequest(req_id, ids, params))
        while core.has_unfinished_requests():
            out = core.step()
            for req_id, new in zip(out.req_ids, out.new_token_ids, strict=True):
                tokens[req_id].extend(new)
            for request in core.scheduler.running:
                tables = request.group_blocks
                assert tables is not None
                released = max(released, sum(t.count(NULL_BLOCK) for t in tables))
            stats = core.get_stats()
            window_used = [g.blocks_in_use for g in stats.kv_groups if g.window]
            assert sum(g.blocks_in_use for g in stats.kv_groups) == (
                stats.num_kv_blocks - stats.num_free_kv_blocks
            )
            assert window_used
        assert released > 0  # the window groups really released blocks behind the window
        for req_id, out_tokens in tokens.items():
            assert out_tokens == greedy(model.hf, prompts[req_id], 12), req_id
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    finally:
        core.close()
