"""Checks of a backend's tensor parallelism at the engine's level: the engine in its own process
(as ``AsyncLLM`` runs it), its client, and the backend's worker processes.

::

    from engine_core.testing import check_worker_death

    @pytest.mark.anyio
    async def test_worker_death() -> None:
        await check_worker_death(EngineConfig(backend="mine", tensor_parallel_size=2, ...))
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.mp.client import MPClient
from engine_core.config import EngineConfig
from engine_core.errors import EngineDeadError
from engine_core.sampling_params import SamplingParams

__all__ = ["check_worker_death", "child_pids"]


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``): an engine's TP workers, when the
    backend starts nothing else."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


async def check_worker_death(
    config: EngineConfig,
    *,
    worker_pids: Callable[[int], Sequence[int]] = child_pids,
    prompt_token_ids: Sequence[int] = (1, 2, 3),
    within_s: float = 1.0,
    first_output_s: float = 30.0,
) -> None:
    """A ``kill -9`` of the worker of rank 1 (``config`` has two ranks) while a request decodes
    reaches the client as :class:`~engine_core.EngineDeadError` naming rank 1 (in the error or
    its cause) within ``within_s`` seconds. ``worker_pids(engine_pid)``: the pids of the
    engine's worker processes (exactly one with two ranks: rank 0 is the engine's own)."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    client = await MPClient.start_async(config)
    try:
        client.add_request(EngineCoreRequest("tp-death", list(prompt_token_ids), params))
        with anyio.fail_after(first_output_s):
            while not (await client.get_output_async()).req_ids:
                await anyio.lowlevel.checkpoint()
        assert client.pid is not None
        workers = list(worker_pids(client.pid))
        assert len(workers) == 1, f"expected one worker process (rank 1), found {workers}"
        killed_at = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        try:
            with anyio.fail_after(within_s + 5.0):
                while True:
                    outputs = await client.get_output_async()
                    assert not outputs.finished, "the request finished after its worker died"
                    await anyio.lowlevel.checkpoint()
        except EngineDeadError as exc:
            elapsed = time.monotonic() - killed_at
            message = f"{exc} {exc.__cause__}"
        assert elapsed < within_s, f"the death took {elapsed:.2f} s to reach the client"
        assert "rank 1" in message, f"the error does not name rank 1: {message}"
    finally:
        await client.shutdown_async()
