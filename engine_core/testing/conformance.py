"""The backend conformance checks (``check_*``, :data:`BACKEND_CHECKS`, :func:`check_backend`),
exported by :mod:`engine_core.testing`, whose docstring says how to use them. They drive a backend
through the real scheduler with the harnesses of :mod:`engine_core.testing.harness`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

from engine_core._core.kv_groups import plan_kv_layout
from engine_core.abc import Backend, KVCacheSpec, SpecSupport, TokenLogprobs
from engine_core.config import EngineConfig
from engine_core.testing.harness import (
    MAX_BLOCKS,
    BackendFactory,
    Harness,
    assert_same,
    default_config,
    initialize_kv,
    make_prompt,
    num_blocks_for,
    opened,
)
from engine_core.testing.spec_harness import SpecHarness

__all__ = [
    "BACKEND_CHECKS",
    "BackendFactory",
    "check_abort",
    "check_async_scheduling",
    "check_backend",
    "check_close",
    "check_decode",
    "check_greedy_determinism",
    "check_kv_groups",
    "check_logprobs",
    "check_mixed_batch",
    "check_preemption",
    "check_prefill_chunks",
    "check_prefix_caching",
    "check_spec_decode",
    "check_startup",
]


def check_startup(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Construction, the KV geometry, the vocabulary, the memory report and KV allocation."""
    config = config or default_config()
    backend = make_backend(config)
    try:
        assert isinstance(backend, Backend), f"{backend!r} is not an engine_core.abc.Backend"
        spec = backend.kv_cache_spec()
        if isinstance(spec, KVCacheSpec):
            for field in ("num_layers", "num_kv_heads", "head_size", "dtype_bytes"):
                value = getattr(spec, field)
                assert isinstance(value, int) and not isinstance(value, bool) and value > 0, (
                    f"kv_cache_spec().{field} must be a positive int, got {value!r}"
                )
        else:
            assert isinstance(spec, list | tuple), f"kv_cache_spec() returned {spec!r}"
        layout = plan_kv_layout(spec, config.block_size)  # ValueError names a bad layer
        vocab_size = backend.vocab_size()
        assert isinstance(vocab_size, int) and vocab_size >= 256, (
            f"vocab_size() must be an int >= 256 for these checks, got {vocab_size!r}"
        )
        max_model_len = backend.max_model_len()
        assert max_model_len is None or (isinstance(max_model_len, int) and max_model_len > 0), (
            f"max_model_len() must be None or a positive int, got {max_model_len!r}"
        )
        memory = backend.available_kv_cache_memory()
        bytes_per_block = layout.page_size_bytes
        assert isinstance(memory, int) and memory >= bytes_per_block, (
            f"available_kv_cache_memory() must be an int of at least one block "
            f"({bytes_per_block} bytes), got {memory!r}"
        )
        num_blocks = min(memory // bytes_per_block, MAX_BLOCKS)
        initialize_kv(backend, config, num_blocks)
    finally:
        backend.close()


def check_prefill_chunks(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """A prompt prefilled over several steps gets no token until its last chunk, then one; the
    tokens equal those of an unchunked prefill."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        bs = h.block_size
        prompt = make_prompt(1, 3 * bs + bs // 2 + 1)  # four chunks of at most bs tokens
        expected = h.generate("whole", prompt, 4)
        h.set_token_budget(bs)
        h.add("chunked", prompt, 4)
        for chunk in range(3):
            scheduler_output, output = h.step()
            assert scheduler_output.total_num_scheduled_tokens == bs
            assert output.sampled_token_ids == [[]], (
                f"prefill chunk {chunk + 1} of 4 should give no token, got "
                f"{output.sampled_token_ids}"
            )
        _, output = h.step()
        assert len(output.sampled_token_ids[0]) == 1, "the last prefill chunk gives one token"
        assert_same("chunked prefill", h.run()["chunked"], expected)


def check_decode(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """After the prefill, each step schedules one token of the request and gets one token."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        h.add("decode", make_prompt(2, 10), 8)
        scheduler_output, _ = h.step()
        assert [r.req_id for r in scheduler_output.new_reqs] == ["decode"]
        for step in range(2, 9):
            scheduler_output, output = h.step()
            assert scheduler_output.cached.req_ids == ["decode"]
            assert scheduler_output.cached.num_scheduled_tokens == [1]
            assert len(output.sampled_token_ids[0]) == 1, f"decode step {step} gave no token"
        assert not h.scheduler.has_unfinished_requests()
        assert len(h.outputs["decode"]) == 8


def check_mixed_batch(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """A batch holding a decode and a prefill chunk gives each request its own tokens."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        bs = h.block_size
        decoding, prefilling = make_prompt(3, 5), make_prompt(4, 2 * bs + 3)
        expected_decoding = h.generate("decoding-alone", decoding, 12)
        expected_prefilling = h.generate("prefilling-alone", prefilling, 3)
        h.set_token_budget(bs)
        h.add("decoding", decoding, 12)
        h.step()
        h.add("prefilling", prefilling, 3)
        scheduler_output, output = h.step()
        assert scheduler_output.req_ids == ["decoding", "prefilling"]
        assert [len(t) for t in output.sampled_token_ids] == [1, 0], (
            f"a decode + prefill-chunk batch gave {output.sampled_token_ids}"
        )
        outputs = h.run()
        assert_same("decode in a mixed batch", outputs["decoding"], expected_decoding)
        assert_same("prefill in a mixed batch", outputs["prefilling"], expected_prefilling)


def check_abort(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Requests ended through ``finished_req_ids`` (mid-prefill and mid-decode) lose their state:
    the same id can come back as a new request."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        bs = h.block_size
        second, third = make_prompt(6, bs + 2), make_prompt(7, 4)
        expected_second = h.generate("second-alone", second, 5)
        expected_third = h.generate("third-alone", third, 5)
        h.set_token_budget(bs)
        h.add("r", make_prompt(5, 2 * bs + 3), 20)
        h.step()  # a partial prefill chunk
        h.abort("r")
        h.add("r", second, 5)
        scheduler_output, _ = h.step()
        assert "r" in scheduler_output.finished_req_ids
        assert [r.req_id for r in scheduler_output.new_reqs] == ["r"]
        while len(h.outputs["r"]) < 2:
            h.step()
        assert_same("an id reused after an abort mid-prefill", h.outputs["r"], expected_second[:2])
        h.abort("r")
        h.add("r", third, 5)
        assert_same("an id reused after an abort mid-decode", h.run()["r"], expected_third)


def check_preemption(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Requests dropped through ``preempted_req_ids`` and resumed as new requests carrying
    their ``output_token_ids`` continue exactly where they were."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        bs = h.block_size
        prompts = {
            "a": make_prompt(8, 7),
            "b": make_prompt(9, bs + 1),
            "c": make_prompt(10, 2 * bs + 3),
        }
        expected = {k: h.generate(f"{k}-alone", p, 10) for k, p in prompts.items()}
        h.set_token_budget(bs)
        h.add("a", prompts["a"], 10)
        h.add("b", prompts["b"], 10)
        for _ in range(4):
            h.step()
        h.add("c", prompts["c"], 10)
        h.step()  # "c" runs a partial prefill chunk
        h.scheduler.reset_prefix_cache(reset_running_requests=True)
        before = {k: list(h.outputs[k]) for k in prompts}
        scheduler_output, _ = h.step()
        assert sorted(scheduler_output.preempted_req_ids) == ["a", "b", "c"]
        resumed = {r.req_id: r.output_token_ids for r in scheduler_output.new_reqs}
        for req_id, output_token_ids in resumed.items():
            assert output_token_ids == before[req_id]
        outputs = h.run()
        for req_id in prompts:
            assert_same(
                f"request {req_id!r} resumed after preemption", outputs[req_id], expected[req_id]
            )


def check_prefix_caching(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Requests whose prompt starts with cached blocks (``num_computed_tokens`` > 0 on arrival)
    give the tokens of a cold run, alone and while sharing blocks with live requests."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        bs = h.block_size
        shared = make_prompt(11, 3 * bs)
        x, y = [*shared, 1, 2], [*shared, 3]
        expected_x = h.generate("x-cold", x, 6)
        expected_y = h.generate("y-cold", y, 6)
        h.add("x-warm-1", x, 6, cold=False)  # fills the cache
        h.run()
        h.add("x-warm-2", x, 6, cold=False)
        h.add("y-warm", y, 6, cold=False)
        scheduler_output, _ = h.step()
        hits = [r.num_computed_tokens for r in scheduler_output.new_reqs]
        assert hits == [3 * bs, 3 * bs], f"expected prefix-cache hits, the scheduler gave {hits}"
        outputs = h.run()
        assert_same("a warm prefix", outputs["x-warm-1"], expected_x)
        assert_same("a prefix-cache hit", outputs["x-warm-2"], expected_x)
        assert_same("a shared prefix with another suffix", outputs["y-warm"], expected_y)


def check_kv_groups(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """A backend with window or chunked layers (per-layer specs): prompts several windows long,
    prefilled in chunks across the window's edge while other requests take the blocks the
    windows release, give the tokens of a run in one chunk, alone; prefix hits (whose window
    tables start with null ids) give them too. A window layer that read a released block would
    see another request's KV. Nothing to check for a backend of full-attention layers."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        spans = [g.span for g in h.kv_layout.groups if g.span is not None]
        if not spans:
            return
        bs = h.block_size
        span = max(spans)
        length = min(3 * span + bs + 3, h.scheduler.config.max_model_len - 16)
        prompts = {f"long-{i}": make_prompt(30 + i, length - 5 * i) for i in range(3)}
        expected = {req_id: h.generate(f"{req_id}-alone", p, 8) for req_id, p in prompts.items()}
        h.set_token_budget(max(bs, span // 2 + 3))  # chunks that start inside the window
        for req_id, prompt in prompts.items():
            h.add(req_id, prompt, 8, cold=False)
        outputs = h.run()
        for req_id in prompts:
            assert_same(f"{req_id} prefilled in chunks", outputs[req_id], expected[req_id])
        for req_id, prompt in prompts.items():
            h.add(f"{req_id}-hit", prompt, 8, cold=False)
        scheduler_output, _ = h.step()
        hits = [r.num_computed_tokens for r in scheduler_output.new_reqs]
        assert hits and hits[0] > span, f"expected a prefix hit longer than the window: {hits}"
        outputs = h.run()
        for req_id in prompts:
            assert_same(f"{req_id} from a prefix hit", outputs[f"{req_id}-hit"], expected[req_id])
        _assert_no_leak(h, "KV-cache groups")


def check_greedy_determinism(
    make_backend: BackendFactory, config: EngineConfig | None = None
) -> None:
    """The same greedy prompt gives the same tokens alone, again, and in a batch."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        prompt = make_prompt(12, 9)
        alone = h.generate("alone", prompt, 10)
        assert_same("the same prompt run again", h.generate("again", prompt, 10), alone)
        h.add("other-1", make_prompt(13, 30), 6)
        h.add("batched", prompt, 10)
        h.add("other-2", make_prompt(14, 3), 14)
        assert_same("the same prompt in a batch", h.run()["batched"], alone)


def check_logprobs(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Sample and prompt logprobs: the token first, then the top-k by rank, only when asked."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        prompt = make_prompt(15, h.block_size + 4)
        h.set_token_budget(h.block_size)
        h.add("plain", make_prompt(16, 3), 4)
        h.add("asked", prompt, 4, logprobs=3, prompt_logprobs=2)
        outputs = h.run()
        assert "plain" not in h.logprobs and "plain" not in h.prompt_logprobs, (
            "a request that asked for no logprobs got some"
        )
        entries = h.logprobs.get("asked", [])
        assert len(entries) == len(outputs["asked"]), (
            f"expected one logprobs entry per sampled token, got {len(entries)} for "
            f"{len(outputs['asked'])} tokens"
        )
        for token, entry in zip(outputs["asked"], entries, strict=True):
            _check_token_logprobs(entry, token, 3, "sampled")
            assert entry.ranks[0] == 1 and entry.token_ids[1] == token, (
                f"the greedy token {token} must be the top-1 token, got {entry}"
            )
        prompt_entries = h.prompt_logprobs.get("asked", [])
        assert len(prompt_entries) == len(prompt), (
            f"expected {len(prompt)} prompt logprobs entries, got {len(prompt_entries)}"
        )
        assert prompt_entries[0] is None, "prompt position 0 has no logprobs (None)"
        for position, prompt_entry in enumerate(prompt_entries[1:], start=1):
            assert prompt_entry is not None, f"prompt position {position} has no logprobs"
            _check_token_logprobs(prompt_entry, prompt[position], 2, f"prompt position {position}")


def _check_token_logprobs(entry: TokenLogprobs, token: int, num_top: int, where: str) -> None:
    assert isinstance(entry, TokenLogprobs), f"{where}: {entry!r} is not TokenLogprobs"
    n = num_top + 1
    assert len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks) == n, (
        f"{where}: expected the token and the top {num_top}, got {entry}"
    )
    assert entry.token_ids[0] == token, f"{where}: the first entry must be token {token}: {entry}"
    assert entry.ranks[1:] == list(range(1, n)), f"{where}: top-k ranks must be 1..k: {entry}"
    assert entry.ranks[0] >= 1, f"{where}: ranks are 1-based: {entry}"
    assert all(math.isfinite(v) and v <= 0.0 for v in entry.logprobs), (
        f"{where}: logprobs must be finite and <= 0: {entry}"
    )
    assert all(a >= b for a, b in pairwise(entry.logprobs[1:])), (
        f"{where}: top-k must be sorted: {entry}"
    )


def check_async_scheduling(
    make_backend: BackendFactory, config: EngineConfig | None = None
) -> None:
    """With ``supports_async_scheduling`` set, steps launched while the previous one is in
    flight (``sample_tokens_async``; the next ``execute_model`` before ``get_output``) give the
    tokens of synchronous steps: chunked prefills, prefix hits, a preemption and an abort while
    a token is in flight, an id reused after it. A backend that leaves the flag False passes:
    the engine never schedules it asynchronously."""
    config = config or default_config()
    with opened(make_backend, config) as h:
        if not h.backend.supports_async_scheduling:
            return
        bs = h.block_size
        shared = make_prompt(19, 2 * bs)
        prompts = {
            "a": make_prompt(20, 5),
            "b": shared + make_prompt(21, 3),
            "c": shared + make_prompt(22, bs + 1),
            "d": make_prompt(23, 2 * bs + 3),
        }
        expected = {k: h.generate(f"{k}-alone", p, 12) for k, p in prompts.items()}
    with opened(make_backend, config, async_scheduling=True) as a:
        a.set_token_budget(bs)
        a.add("a", prompts["a"], 12)
        a.add("b", prompts["b"], 12, cold=False)
        a.add("d", prompts["d"], 12)
        for _ in range(4):
            a.step()
        a.add("c", prompts["c"], 12, cold=False)  # its shared prefix is cached by now
        a.step()
        a.step()
        # Preempt everything while a step with their tokens is in flight: each resumes with
        # the token that step sampled.
        running = sorted(r.request_id for r in a.scheduler.running)
        assert any(r.num_output_placeholders for r in a.scheduler.running)
        a.scheduler.reset_prefix_cache(reset_running_requests=True)
        # The backend hears of it with the next step that runs (the first may only wait for
        # the step in flight: the preempted requests resume once they have its tokens).
        scheduler_output, _ = a.step()
        if scheduler_output.is_empty:
            scheduler_output, _ = a.step()
        assert sorted(scheduler_output.preempted_req_ids) == running
        while len(a.outputs["d"]) < 8:
            a.step()
        a.abort("d")  # its next token is in flight: it is discarded
        aborted = list(a.outputs["d"])
        a.add("d", prompts["a"], 12)  # the id comes back at once
        outputs = a.run()
        for req_id in "abc":
            assert_same(
                f"request {req_id!r} under async scheduling", outputs[req_id], expected[req_id]
            )
        assert_same("a request aborted with a token in flight", aborted, expected["d"][:8])
        assert_same("an id reused at once after that abort", outputs["d"], expected["a"])


def check_spec_decode(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """With ``spec_support()`` set, verifying drafts gives the tokens of decoding without them:
    a reference run without drafts, then the same requests with scripted drafts (all right,
    all wrong, mixed), drafts running into ``max_tokens``, a stop token and ``max_model_len``,
    a preemption of drafting requests, a chunked prefill beside them, and (with
    ``exact_verification``) seeded sampling at temperature > 0. Every result must be one a
    verifier returns (the accepted drafts, then one token that differs from the next), the
    backend's computed tokens must follow the rollback (``CachedRequestData.diffs`` checks
    them), and no KV block may leak. A backend whose ``spec_support()`` is None passes: the
    engine never sends it drafts."""
    config = config or default_config()
    backend = make_backend(config)
    try:
        support = backend.spec_support()
    finally:
        backend.close()
    if support is None:
        return
    assert isinstance(support, SpecSupport), f"spec_support() returned {support!r}"
    bs = config.block_size
    prompts = {
        "a": make_prompt(30, 7),
        "b": make_prompt(31, bs + 3),
        "c": make_prompt(32, 2 * bs + 1),
    }
    num_out = max(3 * bs, 24)
    sampled: dict[str, Any] = {"temperature": 0.8, "seed": 7}
    with opened(make_backend, config) as h:
        expected = {k: h.generate(f"{k}-ref", p, num_out) for k, p in prompts.items()}
        max_model_len = h.scheduler.config.max_model_len
        edge_prompt = make_prompt(33, max_model_len - 6)
        expected_edge = h.generate("edge-ref", edge_prompt, 10)
    references = {k: prompts[k] + expected[k] for k in prompts}
    patterns = {
        "all right": lambda position, i: True,
        "all wrong": lambda position, i: False,
        "mixed": lambda position, i: (position * 7 + i * 3) % 5 < 3,
    }
    for label, right in patterns.items():
        with _spec_opened(make_backend, config, support) as h:
            h.proposer.sequences = list(references.values())
            h.proposer.right = right
            for k, prompt in prompts.items():
                h.add(k, prompt, num_out)
            outputs = h.run()
            for k in prompts:
                assert_same(f"drafts {label}, request {k!r}", outputs[k], expected[k])
            assert h.num_verified > 0, f"drafts {label}: nothing was verified"
            if label == "all wrong":
                assert h.num_rejected == h.num_verified
            _assert_no_leak(h, f"drafts {label}")
    with _spec_opened(make_backend, config, support) as h:
        # Limits among the drafts: max_tokens, a stop token, max_model_len.
        h.proposer.sequences = [*references.values(), edge_prompt + expected_edge]
        stop = expected["b"][5]
        h.add("short", prompts["a"], 5)
        h.add("stop", prompts["b"], num_out, stop_token_ids=[stop])
        h.add("edge", edge_prompt, 10)
        outputs = h.run()
        assert_same("drafts past max_tokens", outputs["short"], expected["a"][:5])
        first_stop = expected["b"].index(stop)
        assert_same("drafts past a stop token", outputs["stop"], expected["b"][: first_stop + 1])
        assert_same("drafts past max_model_len", outputs["edge"], expected_edge[:6])
        _assert_no_leak(h, "drafts past the limits")
    with _spec_opened(make_backend, config, support) as h:
        # A preemption of requests with drafts in flight, then a chunked prefill beside them.
        h.proposer.sequences = list(references.values())
        h.proposer.right = patterns["mixed"]
        h.add("a", prompts["a"], num_out)
        h.add("b", prompts["b"], num_out)
        h.step()
        h.step()
        assert [r.request_id for r in h.scheduler.running] == ["a", "b"]
        h.scheduler.reset_prefix_cache(reset_running_requests=True)
        h.step()
        h.step()
        h.set_token_budget(bs)
        h.add("c", prompts["c"], num_out)
        outputs = h.run()
        for k in prompts:
            assert_same(f"preemption and chunked prefill, request {k!r}", outputs[k], expected[k])
        _assert_no_leak(h, "preemption and chunked prefill")
    if support.exact_verification:
        with opened(make_backend, config) as ref:
            request = "seeded-ref"
            ref.add_sampled(request, prompts["c"], num_out, **sampled)
            expected_seeded = ref.run()[request]
        with _spec_opened(make_backend, config, support) as h:
            h.proposer.sequences = [prompts["c"] + expected_seeded]
            h.proposer.right = patterns["mixed"]
            h.add_sampled("seeded", prompts["c"], num_out, **sampled)
            outputs = h.run()
            assert_same("seeded sampling with drafts", outputs["seeded"], expected_seeded)
            _assert_no_leak(h, "seeded sampling")


@contextmanager
def _spec_opened(
    make_backend: BackendFactory, config: EngineConfig, support: SpecSupport
) -> Iterator[SpecHarness]:
    backend = make_backend(config)
    try:
        num_blocks = num_blocks_for(backend, config)
        initialize_kv(backend, config, num_blocks)
        yield SpecHarness(backend, config, num_blocks, support)
    finally:
        backend.close()


def _assert_no_leak(h: Harness, label: str) -> None:
    kv = h.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, (
        f"{label}: {kv.num_blocks - kv.num_free_blocks} KV blocks still held after every "
        "request ended"
    )


def check_close(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """``close()`` succeeds while requests are still live."""
    config = config or default_config()
    backend = make_backend(config)
    try:
        num_blocks = num_blocks_for(backend, config)
        initialize_kv(backend, config, num_blocks)
        h = Harness(backend, config, num_blocks)
        h.add("open-1", make_prompt(17, 5), 10)
        h.add("open-2", make_prompt(18, 6), 10)
        h.step()
        h.step()
    except BaseException:
        backend.close()
        raise
    result = backend.close()  # type: ignore[func-returns-value]
    assert result is None, f"close() returned {result!r}"


BACKEND_CHECKS: tuple[Callable[[BackendFactory, EngineConfig | None], None], ...] = (
    check_startup,
    check_prefill_chunks,
    check_decode,
    check_mixed_batch,
    check_abort,
    check_preemption,
    check_prefix_caching,
    check_kv_groups,
    check_greedy_determinism,
    check_logprobs,
    check_async_scheduling,
    check_spec_decode,
    check_close,
)
"""Every check, in the order :func:`check_backend` runs them."""


def check_backend(make_backend: BackendFactory, config: EngineConfig | None = None) -> None:
    """Run every check of :data:`BACKEND_CHECKS` against backends from ``make_backend``."""
    for check in BACKEND_CHECKS:
        check(make_backend, config)
