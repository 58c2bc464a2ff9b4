"""``fd_wait.ReadableWaiter``: wakes on each readable turn of a descriptor, survives cancelled
waits, and lets an asyncio loop drop a descriptor nobody reads (so it never spins on it)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest

from engine_core._engine.pipes.fd_wait import ReadableWaiter

_TIMEOUT_S = 5.0


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    try:
        yield read_fd, write_fd
    finally:
        os.close(read_fd)
        os.close(write_fd)


async def _wait_then_read(waiter: ReadableWaiter, read_fd: int, write_fd: int) -> bytes:
    """Start a wait, make the descriptor readable once the wait is pending, return what was
    read after the wait ended."""
    woken = anyio.Event()

    async def wait() -> None:
        await waiter.wait()
        woken.set()

    with anyio.fail_after(_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.lowlevel.checkpoint()  # the wait is pending now
            assert not woken.is_set()
            os.write(write_fd, b"x")
            await woken.wait()
    return os.read(read_fd, 16)


@pytest.mark.anyio
async def test_each_wait_wakes_when_the_descriptor_turns_readable(
    pipe: tuple[int, int],
) -> None:
    waiter = ReadableWaiter(pipe[0])
    try:
        for _ in range(3):
            assert await _wait_then_read(waiter, *pipe) == b"x"
    finally:
        waiter.close()


@pytest.mark.anyio
async def test_a_cancelled_wait_leaves_the_waiter_usable(pipe: tuple[int, int]) -> None:
    waiter = ReadableWaiter(pipe[0])
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await waiter.wait()
        assert scope.cancelled_caught
        assert await _wait_then_read(waiter, *pipe) == b"x"
    finally:
        waiter.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_drops_a_descriptor_nobody_reads_and_watches_it_again(
    pipe: tuple[int, int],
) -> None:
    read_fd, write_fd = pipe
    loop = asyncio.get_running_loop()
    waiter = ReadableWaiter(read_fd)
    try:
        assert await _wait_then_read(waiter, *pipe) == b"x"
        # Registered between waits: a readable descriptor nobody waits for is dropped on the
        # second callback that finds nobody waiting.
        os.write(write_fd, b"y")
        for _ in range(4):
            await asyncio.sleep(0)
        assert not loop.remove_reader(read_fd)  # nothing left registered
        # The next wait registers it again and returns at once (the byte is still there).
        with anyio.fail_after(_TIMEOUT_S):
            await waiter.wait()
        assert os.read(read_fd, 16) == b"y"
        waiter.close()
        waiter.close()
        assert not loop.remove_reader(read_fd)
    finally:
        waiter.close()
