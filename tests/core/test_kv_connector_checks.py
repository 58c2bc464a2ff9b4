"""engine_core.testing's connector checks: the host tier passes them; broken connectors fail."""

from __future__ import annotations

from typing import Any

import pytest
from engine_core_mock._backend import MockBackend

from engine_core._core.host_tier import HostTierScheduler
from engine_core.config import EngineConfig
from engine_core.kv_connector import KVConnectorMetadata
from engine_core.testing import check_kv_connector_scheduler, check_kv_connector_worker

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_the_host_tier_passes(num_groups: int) -> None:
    check_kv_connector_scheduler(HostTierScheduler, num_groups=num_groups)


class OffersTheLastToken(HostTierScheduler):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        num, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (num + self.block_size, is_async) if num else (num, is_async)


class LoadsTheWrongSlot(HostTierScheduler):
    def build_metadata(self, step: Any) -> KVConnectorMetadata | None:
        meta = super().build_metadata(step)
        if meta is not None:
            for load in meta.loads:
                load.remote = [list(reversed(r)) for r in load.remote]
        return meta


class LoadsIntoTheWrongBlocks(HostTierScheduler):
    def build_metadata(self, step: Any) -> KVConnectorMetadata | None:
        meta = super().build_metadata(step)
        if meta is not None:
            for load in meta.loads:
                load.first_block += 1
        return meta


@pytest.mark.parametrize(
    "broken,message",
    [
        (OffersTheLastToken, "the last token must be computed|ended by the connector"),
        (LoadsTheWrongSlot, "loaded the wrong block"),
        (LoadsIntoTheWrongBlocks, "not the block the core allocated"),
    ],
)
def test_a_broken_connector_fails(broken: type[HostTierScheduler], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_kv_connector_scheduler(broken)


def test_the_mock_backend_passes_the_worker_check() -> None:
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        num_kv_blocks=40,
        max_model_len=512,
        kv_offload_bytes=1 << 20,
        backend_options={
            "num_layers": 2,
            "num_kv_heads": 1,
            "head_size": 8,
            "kv_link": {"host_memory_bytes": 1 << 40},
        },
    )
    check_kv_connector_worker(MockBackend, config)
