"""The mock's worker half of the ``"pd"`` connector alone: an export read by a load delivers
exactly the exported blocks' content; a load whose export was given up while it copied (an
expired lease) fails instead of using the freed blocks; a release frees the export. The same
over the authenticated ZMQ transport, and a reader with other keys is refused."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from engine_core_mock._blocks import BlockLedger
from engine_core_mock._kv_link import KVLinkOptions
from engine_core_mock._pd_link import MockPDWorker

from engine_core._core.pd_connector import PDConnectorScheduler
from engine_core._engine.pipes.addresses import DeploymentKeys, deployment_keys
from engine_core._engine.pipes.pd_transport import KEYS_OPTION
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVTransfer,
)

LAYOUT = KVConnectorLayout(
    num_blocks=8,
    block_size=4,
    kv_groups=[[0]],
    group_kinds=["full_attention"],
    group_spans=[None],
    page_size_bytes=1 << 20,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(link: KVLinkOptions) -> tuple[PDConnectorScheduler, MockPDWorker, MockPDWorker, _Clock]:
    config = EngineConfig(data_parallel_size=2, data_parallel_rank=0)
    owner = PDConnectorScheduler(config, LAYOUT)  # creates the prefill side's segment
    clock = _Clock()
    prefill = MockPDWorker(config, LAYOUT, link, clock)
    decode = MockPDWorker(
        EngineConfig(data_parallel_size=2, data_parallel_rank=1), LAYOUT, link, clock
    )
    for worker in (prefill, decode):
        worker.register_kv_caches(BlockLedger(8, 4, lambda _b: []))
    return owner, prefill, decode, clock


def _export(owner: PDConnectorScheduler, epoch: int, lease_s: float) -> KVTransfer:
    slot = owner._free_slots.pop()
    owner.segment.done[slot] = 0
    owner.segment.renew[slot] = 0.0
    params = {"epoch": epoch, "slot": slot, "lease_s": lease_s}
    return KVTransfer("r", "r", [[2, 3]], [[2, 3]], 0, 8, params=params)


def _load(owner: PDConnectorScheduler, save: KVTransfer) -> KVTransfer:
    assert save.params is not None
    params = {"segment": owner.segment.name, **save.params}
    return KVTransfer("r", "r", [[5, 6]], [[2, 3]], 0, 8, params=params)


def test_a_load_delivers_the_exported_content_and_confirms() -> None:
    owner, prefill, decode, clock = _pair(KVLinkOptions(latency_s=0.5, deadline_s=5.0))
    try:
        src = prefill._ledger
        dst = decode._ledger
        assert src is not None and dst is not None
        src.set_content(2, 1234)
        src.set_content(3, 5678)
        save = _export(owner, 7, 30.0)
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode.start_step(KVConnectorMetadata(loads=[_load(owner, save)]))
        assert decode.finished_by(clock.now) is None  # copying
        clock.now += 0.6
        report = decode.finished_by(clock.now)
        assert report is not None and report.finished_loads == ["r"]
        assert not report.failed_block_ids
        assert (dst.content(5), dst.content(6)) == (1234, 5678)
        assert prefill.finished_by(clock.now) is None  # the scheduler half confirms, not the load
        owner.segment.done[save.params["slot"]] = 7  # type: ignore[index]
        done = prefill.finished_by(clock.now)
        assert done is not None and done.finished_saves == ["r"]
    finally:
        owner.close()


def test_an_export_given_up_mid_copy_fails_the_load() -> None:
    owner, prefill, decode, clock = _pair(KVLinkOptions(latency_s=0.5, deadline_s=5.0))
    try:
        src = prefill._ledger
        assert src is not None
        src.set_content(2, 1)
        src.set_content(3, 2)
        save = _export(owner, 9, 0.05)  # a lease shorter than the copy
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode._renew = False
        decode.start_step(KVConnectorMetadata(loads=[_load(owner, save)]))
        time.sleep(0.06)
        expired = prefill.finished_by(clock.now)
        assert expired is not None and expired.failed_saves == ["r"]  # unpublished, then freed
        clock.now += 0.6
        report = decode.finished_by(clock.now)
        assert report is not None and report.finished_loads == ["r"]
        assert report.failed_block_ids == [[5, 6]]  # never the freed blocks' content
        assert report.bytes_loaded == 0
    finally:
        owner.close()


def test_renewals_keep_an_export_while_it_is_copied() -> None:
    owner, prefill, decode, clock = _pair(KVLinkOptions(latency_s=0.5, deadline_s=5.0))
    try:
        src = prefill._ledger
        assert src is not None
        src.set_content(2, 3)
        src.set_content(3, 4)
        save = _export(owner, 11, 0.05)
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode.start_step(KVConnectorMetadata(loads=[_load(owner, save)]))
        for _ in range(3):
            time.sleep(0.03)
            assert decode.finished_by(clock.now) is None  # copying: renews
            assert prefill.finished_by(clock.now) is None  # renewed: kept
        assert save.params is not None
        assert owner.segment.renew[save.params["slot"]] > 0  # the stamp the cores' leases read
        clock.now += 0.6
        report = decode.finished_by(clock.now)
        assert report is not None and not report.failed_block_ids
    finally:
        owner.close()


# -- over the authenticated ZMQ transport ---------------------------------------------------------


_KEYS = deployment_keys()


def _zmq_pair(
    link: KVLinkOptions, decode_keys: DeploymentKeys | None = None
) -> tuple[PDConnectorScheduler, MockPDWorker, MockPDWorker, _Clock]:
    keys = _KEYS

    def config(rank: int, k: DeploymentKeys) -> EngineConfig:
        options = {KEYS_OPTION: msgspec.to_builtins(k), "pd_transport": "zmq", "pd_timeout_s": 2.0}
        return EngineConfig(
            data_parallel_size=2, data_parallel_rank=rank, kv_connector_options=options
        )

    clock = _Clock()
    prefill = MockPDWorker(config(0, keys), LAYOUT, link, clock)  # its server starts first
    owner = PDConnectorScheduler(config(0, keys), LAYOUT)
    decode = MockPDWorker(config(1, decode_keys or keys), LAYOUT, link, clock)
    for worker in (prefill, decode):
        worker.register_kv_caches(BlockLedger(8, 4, lambda _b: []))
    return owner, prefill, decode, clock


def _zmq_load(owner: PDConnectorScheduler, prefill: MockPDWorker, save: KVTransfer) -> KVTransfer:
    assert save.params is not None and prefill._remote is not None
    params = {"address": prefill._remote.address, "via": "zmq", **save.params}
    return KVTransfer("r", "r", [[5, 6]], [[2, 3]], 0, 8, params=params)


def _finish(worker: MockPDWorker, clock: _Clock, timeout_s: float = 3.0) -> KVConnectorReport:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = worker.finished_by(clock.now)
        if report is not None:
            return report
        time.sleep(0.005)
    raise AssertionError("the load never finished")


def _close(*parts: Any) -> None:
    for part in parts:
        part.close()


def test_a_load_over_zmq_delivers_the_exported_content_and_renews() -> None:
    owner, prefill, decode, clock = _zmq_pair(KVLinkOptions(latency_s=0.5, deadline_s=5.0))
    try:
        src, dst = prefill._ledger, decode._ledger
        assert src is not None and dst is not None
        src.set_content(2, 1234)
        src.set_content(3, 5678)
        save = _export(owner, 7, 30.0)
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode.start_step(KVConnectorMetadata(loads=[_zmq_load(owner, prefill, save)]))
        assert decode.finished_by(clock.now) is None  # copying: renews over ZMQ
        slot = save.params["slot"]  # type: ignore[index]
        deadline = time.monotonic() + 2.0
        while not owner.segment.renew[slot] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert owner.segment.renew[slot] > 0  # stamped by the server, on the prefill's clock
        clock.now += 0.6
        report = _finish(decode, clock)
        assert report.finished_loads == ["r"] and not report.failed_block_ids
        assert (dst.content(5), dst.content(6)) == (1234, 5678)
        assert decode._remote is not None
        decode._remote.release(_zmq_load(owner, prefill, save).params or {})  # the confirmation
        done = _finish(prefill, clock)
        assert done.finished_saves == ["r"]
    finally:
        _close(decode, prefill, owner)


def test_a_load_over_zmq_of_an_export_given_up_fails() -> None:
    owner, prefill, decode, clock = _zmq_pair(KVLinkOptions(latency_s=0.5, deadline_s=5.0))
    try:
        src = prefill._ledger
        assert src is not None
        src.set_content(2, 1)
        src.set_content(3, 2)
        save = _export(owner, 9, 0.05)  # a lease shorter than the copy
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode._renew = False
        decode.start_step(KVConnectorMetadata(loads=[_zmq_load(owner, prefill, save)]))
        time.sleep(0.06)
        expired = prefill.finished_by(clock.now)
        assert expired is not None and expired.failed_saves == ["r"]  # unpublished, then freed
        clock.now += 0.6
        report = _finish(decode, clock)
        assert report.failed_block_ids == [[5, 6]]  # the server refused: never freed blocks
        assert report.bytes_loaded == 0
        assert prefill._remote is not None and prefill._remote.server.refused_reads == 1
    finally:
        _close(decode, prefill, owner)


@pytest.mark.parametrize("which", ["all", "client"])
def test_other_keys_are_refused_counted_and_the_load_fails(which: str) -> None:
    other = deployment_keys()
    if which == "client":  # the server's public key is right, the client key is not admitted
        other = msgspec.structs.replace(
            other, server_public=_KEYS.server_public, server_secret=_KEYS.server_secret
        )
    owner, prefill, decode, clock = _zmq_pair(
        KVLinkOptions(latency_s=0.01, deadline_s=5.0), decode_keys=other
    )
    try:
        src = prefill._ledger
        assert src is not None
        src.set_content(2, 1)
        src.set_content(3, 2)
        save = _export(owner, 13, 30.0)
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        decode.start_step(KVConnectorMetadata(loads=[_zmq_load(owner, prefill, save)]))
        clock.now += 0.1
        report = _finish(decode, clock, timeout_s=1.5)  # refused at the handshake, not timed out
        assert report.failed_block_ids == [[5, 6]]
        assert decode._remote is not None and decode._remote.auth_refused >= 1
        assert prefill._remote is not None and prefill._remote.server.reads == 0
    finally:
        _close(decode, prefill, owner)
