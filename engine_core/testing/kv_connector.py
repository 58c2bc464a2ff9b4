"""Checks for KV connectors (``docs/kv_connector.md``).

- :func:`check_kv_connector_scheduler` drives a connector's scheduler half through the real
  scheduler, against a simulated worker half that performs every transfer exactly as asked on a
  simulated KV cache (each block holds a fingerprint of the token prefix it was computed for),
  and checks the contract: offers of whole blocks that never include a request's last token;
  loads only into blocks the core allocated for them; saves only of full blocks computed before
  the step; unique transfer ids; loads that deliver the KV of the right prefix; nothing pinned,
  parked or held once every request ended.
- :func:`check_kv_connector_worker` runs an engine on a backend with the built-in host tier and
  checks that prompts evicted from the device come back from the host tier with the same
  tokens as computed, and that no block leaks.

A deliberately broken connector fails them (``tests/core/test_kv_connector_checks.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine_core._core.kv_groups import KVGroup, KVLayout
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import Backend, ModelRunnerOutput, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorScheduler,
    KVTransfer,
)
from engine_core.sampling_params import SamplingParams

__all__ = ["check_kv_connector_scheduler", "check_kv_connector_worker"]

SchedulerFactory = Callable[[EngineConfig, KVConnectorLayout], KVConnectorScheduler]
VOCAB = 256
MAX_STEPS = 5000


def _fingerprint(tokens: list[int], num_blocks: int, block_size: int, group: int) -> int:
    return hash((group, tuple(tokens[: num_blocks * block_size])))


class _SimWorker:
    """A worker half and a model in one: performs transfers at once (loads report in the same
    step), computes the scheduled tokens into the simulated cache and samples greedily."""

    def __init__(self, num_blocks: int, num_groups: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.contents: list[int | None] = [None] * num_blocks
        self.store: dict[int, int] = {}
        """Connector address (``remote``) -> the content saved there."""
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.in_flight: set[str] = set()
        self.num_loads = 0

    def run(self, so: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
        report = KVConnectorReport()
        meta = so.kv_connector_metadata
        if meta is not None:
            self._transfers(meta, scheduler, report)
        for req_id in so.finished_req_ids + so.preempted_req_ids:
            self.tables.pop(req_id, None)
        sampled: list[list[int]] = []
        bs = self.block_size
        for new in so.new_reqs:
            tables = new.block_ids if self.num_groups > 1 else [new.block_ids]
            self.tables[new.req_id] = [list(t) for t in tables]  # type: ignore[arg-type]
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.tokens[new.req_id] = tokens
            for g, table in enumerate(self.tables[new.req_id]):
                for i in range(new.num_computed_tokens // bs):
                    block = table[i] if i < len(table) else -1
                    if block < 0:
                        continue
                    want = _fingerprint(tokens, i + 1, bs, g)
                    assert self.contents[block] == want, (
                        f"request {new.req_id!r} starts with {new.num_computed_tokens} computed "
                        f"tokens, but block {block} (position {i}, group {g}) does not hold its "
                        "prefix's KV: the connector loaded the wrong block (or none)"
                    )
        cached = so.cached
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                per_group = new_ids if self.num_groups > 1 else [new_ids]
                for g, ids in enumerate(per_group):
                    self.tables[req_id][g].extend(ids)  # type: ignore[arg-type]
        order = [
            (r, c, n)
            for r, c, n in zip(
                cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, strict=True
            )
        ] + [(n.req_id, n.num_computed_tokens, n.num_scheduled_tokens) for n in so.new_reqs]
        for req_id, computed, num in order:
            tokens = self.tokens[req_id]
            end = computed + num
            for g, table in enumerate(self.tables[req_id]):
                for i in range(computed // bs, min(end, len(tokens)) // bs):
                    if i < len(table) and table[i] >= 0:
                        self.contents[table[i]] = _fingerprint(tokens, i + 1, bs, g)
            if end >= len(tokens):
                token = (tokens[-1] + 1) % VOCAB
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            so.req_ids, sampled, kv_connector_report=None if report.is_empty else report
        )

    def _transfers(
        self, meta: KVConnectorMetadata, scheduler: Scheduler, report: KVConnectorReport
    ) -> None:
        connector = scheduler.connector
        assert connector is not None
        for transfer_id in meta.cancelled:
            self.in_flight.discard(transfer_id)
        for save in meta.saves:
            self._check_shape(save)
            self._start(save.transfer_id)
            for ids, remote in zip(save.block_ids, save.remote, strict=True):
                for block, address in zip(ids, remote, strict=True):
                    if block < 0:
                        continue
                    assert self.contents[block] is not None, (
                        f"save {save.transfer_id!r} copies block {block}, which holds no KV"
                    )
                    self.store[address] = self.contents[block]  # type: ignore[assignment]
            self.in_flight.discard(save.transfer_id)
            report.finished_saves.append(save.transfer_id)
        for load in meta.loads:
            self._check_shape(load)
            self._start(load.transfer_id)
            parked = connector.parked.get(load.req_id)
            assert parked is not None, (
                f"load {load.transfer_id!r} is for {load.req_id!r}, which is not waiting for a load"
            )
            tables = connector.tables(parked.request)
            for g, (ids, remote) in enumerate(zip(load.block_ids, load.remote, strict=True)):
                start = load.first_block
                for j, (block, address) in enumerate(zip(ids, remote, strict=True)):
                    if block < 0:
                        continue
                    position = start + j
                    assert position < len(tables[g]) and tables[g][position] == block, (
                        f"load {load.transfer_id!r} writes block {block} at position {position} "
                        f"of group {g}, which is not the block the core allocated there"
                    )
                    assert position * self.block_size >= parked.local_tokens, (
                        f"load {load.transfer_id!r} writes over the device prefix hit "
                        f"(position {position})"
                    )
                    assert address in self.store, (
                        f"load {load.transfer_id!r} reads address {address}, where nothing was "
                        "saved"
                    )
                    self.contents[block] = self.store[address]
            self.in_flight.discard(load.transfer_id)
            self.num_loads += 1
            report.finished_loads.append(load.transfer_id)

    def _start(self, transfer_id: str) -> None:
        assert transfer_id not in self.in_flight, (
            f"transfer id {transfer_id!r} is used by two transfers in flight"
        )
        self.in_flight.add(transfer_id)

    def _check_shape(self, transfer: KVTransfer) -> None:
        assert len(transfer.block_ids) == self.num_groups, (
            f"transfer {transfer.transfer_id!r} has {len(transfer.block_ids)} block lists for "
            f"{self.num_groups} KV-cache groups"
        )
        assert len(transfer.remote) == len(transfer.block_ids) and all(
            len(r) == len(b) for r, b in zip(transfer.remote, transfer.block_ids, strict=True)
        ), f"transfer {transfer.transfer_id!r}: remote and block_ids differ in shape"


def _layout(num_groups: int) -> KVLayout:
    groups = tuple(KVGroup("full_attention", None, (g,)) for g in range(num_groups))
    return KVLayout(groups, 1024, per_layer=num_groups > 1)


def check_kv_connector_scheduler(
    make_scheduler: SchedulerFactory,
    config: EngineConfig | None = None,
    *,
    num_groups: int = 1,
    num_blocks: int = 48,
) -> None:
    """Drive the scheduler half ``make_scheduler(config, layout)`` builds through the real
    scheduler (with preemptions, evictions, re-sent prompts) and check the contract (see the
    module). Raises ``AssertionError`` saying what broke it."""
    if config is None:
        config = EngineConfig(kv_offload_bytes=1 << 20, block_size=16)
    bs = config.block_size
    kv_layout = _layout(num_groups)
    layout = KVConnectorLayout(
        num_blocks=num_blocks,
        block_size=bs,
        kv_groups=kv_layout.kv_groups,
        group_kinds=[g.kind for g in kv_layout.groups],
        group_spans=[g.span for g in kv_layout.groups],
        page_size_bytes=kv_layout.page_size_bytes,
    )
    connector = make_scheduler(config, layout)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=bs
        ),
        num_blocks,
        kv_layout=kv_layout,
        kv_connector=connector,
        connector_name=type(connector).__name__,
    )
    offers_checked = _wrap_offers(connector, bs)
    worker = _SimWorker(num_blocks, num_groups, bs)
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    # Together more than the device cache holds: later rounds hit only through the connector.
    prompts = [[(k * 29 + j * 3) % (VOCAB - 1) + 1 for j in range(96 + 24 * k)] for k in range(6)]
    for round_ in range(3):
        for k, p in enumerate(prompts):
            req_id = f"c{round_}-{k}"
            request = Request(
                req_id, p, SamplingParams(max_tokens=20, temperature=0.0), block_size=bs
            )
            scheduler.add_request(request)
            expected[req_id] = [(p[-1] + 1 + j) % VOCAB for j in range(20)]
            got[req_id] = []
        for _ in range(MAX_STEPS):
            if not scheduler.has_unfinished_requests() and not scheduler.connector_needs_step:
                break
            so = scheduler.schedule()
            out = worker.run(so, scheduler)
            update = scheduler.update_from_output(so, out)
            for req_id, tokens in zip(update.req_ids, update.new_token_ids, strict=True):
                got[req_id] += tokens
            ended = scheduler.take_connector_ended()
            assert not ended, f"requests ended by the connector: {ended}"
        else:
            raise AssertionError(f"requests did not finish within {MAX_STEPS} steps")
    for req_id, tokens in expected.items():
        assert got[req_id] == tokens, (
            f"request {req_id!r}: got {got[req_id]}, expected {tokens} (the connector's loads "
            "changed the output)"
        )
    core = scheduler.connector
    assert core is not None
    assert not core.pins, f"blocks still pinned for transfers {sorted(core.pins)}"
    assert not core.parked, f"requests still parked: {sorted(core.parked)}"
    assert scheduler.kv.num_free_blocks == num_blocks, (
        f"{num_blocks - scheduler.kv.num_free_blocks} KV blocks leaked"
    )
    assert offers_checked[0] > 0, "the connector was never asked for an offer"
    assert worker.num_loads > 0, (
        "the connector loaded nothing: prompts evicted from the device cache never came back"
    )


def _wrap_offers(connector: KVConnectorScheduler, block_size: int) -> list[int]:
    """Check every offer as the core gets it (whole blocks, never the last token)."""
    count = [0]
    inner = connector.get_num_new_matched_tokens

    def checked(request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        count[0] += 1
        result = inner(request, num_computed_tokens)
        num, _ = result
        assert isinstance(num, int) and num >= 0 and num % block_size == 0, (
            f"get_num_new_matched_tokens offered {num!r} tokens: not a whole number of blocks"
        )
        assert num_computed_tokens + num <= len(request.all_token_ids) - 1, (
            f"get_num_new_matched_tokens offered {num} tokens after {num_computed_tokens} for a "
            f"request of {len(request.all_token_ids)}: the last token must be computed"
        )
        return result

    connector.get_num_new_matched_tokens = checked  # type: ignore[method-assign]
    return count


def check_kv_connector_worker(
    backend_cls: type[Backend], config: EngineConfig, *, rounds: int = 3
) -> None:
    """Run an engine on ``backend_cls`` with ``config`` (it must set ``kv_offload_bytes`` and a
    small ``num_kv_blocks``), re-send prompts that no longer fit the device cache, and check
    that they come back from the host tier with the tokens of a run with the tier off, and
    that no block leaks."""
    from engine_core._core.engine_io import EngineCoreRequest
    from engine_core._engine.core import EngineCore

    assert config.kv_offload_bytes, "check_kv_connector_worker needs kv_offload_bytes > 0"

    def run(core: EngineCore) -> dict[str, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        for r in range(rounds):
            for k in range(6):
                p = [(k * 31 + j * 7) % 200 + 1 for j in range(8 * config.block_size + 3)]
                core.add_request(EngineCoreRequest(f"w{r}-{k}", p, params))
            deadline = time.monotonic() + 60
            while core.has_work:
                assert time.monotonic() < deadline, "the engine did not finish"
                out = core.step()
                for req_id, new in zip(out.req_ids, out.new_token_ids, strict=True):
                    tokens.setdefault(req_id, []).extend(new)
                for f in out.finished:
                    assert f.error is None, f"request {f.req_id!r} failed: {f.error}"
        return tokens

    import msgspec

    off = EngineCore(msgspec.structs.replace(config, kv_offload_bytes=0), backend_cls=backend_cls)
    try:
        expected = run(off)
    finally:
        off.close()
    on = EngineCore(config, backend_cls=backend_cls)
    try:
        got = run(on)
        stats = on.get_stats()
        kv = on.scheduler.kv
        connector = on.scheduler.connector
        assert connector is not None
        assert not connector.pins and not connector.parked, "transfers left in flight"
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    finally:
        on.close()
    assert got == expected, "the host tier changed the output"
    assert stats.kv_offload_hit_tokens > 0, "no prompt came back from the host tier"
