"""The Unix stream pipes (``pipes.unix``) and the interface they share with ZMQ's
(``pipes``): frames whole and in order however the kernel splits them, a peer that dies
mid-frame, the bound on a bounded pipe, posts from other threads, nothing left open."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from engine_core._engine.pipes.pipes import Pipes, Receiver, Sender
from engine_core._engine.pipes.unix import StreamReceiver, StreamSender

_TIMEOUT_S = 5.0


@pytest.fixture
def pipes() -> Iterator[Pipes]:
    opened = Pipes()
    try:
        yield opened
    finally:
        opened.close()


def _address(tmp_path: Path, name: str = "pipe") -> str:
    return f"unix://{tmp_path}/{name}"


def _frames() -> list[bytes]:
    """Small and large frames, the large ones many times a socket buffer and a read."""
    big = [bytes([i]) * size for i, size in enumerate((3_000_000, 200_000, 65_537))]
    small = [f"frame {i}".encode() for i in range(50)]
    return [b"", *small[:20], big[0], *small[20:30], big[1], big[2], *small[30:], b"x"]


def _read_all_sync(receiver: Receiver, count: int) -> list[bytes]:
    received: list[bytes] = []
    while len(received) < count:
        assert receiver.poll(_TIMEOUT_S)
        if (frame := receiver.recv_nowait()) is not None:
            received.append(frame)
    return received


@pytest.mark.anyio
async def test_frames_arrive_whole_and_in_order_across_reads(tmp_path: Path, pipes: Pipes) -> None:
    receiver = pipes.receiver(_address(tmp_path))
    sender = pipes.sender(_address(tmp_path), hwm=1)
    frames = _frames()
    received: list[bytes] = []

    async def read() -> None:
        while len(received) < len(frames):
            received.append(await receiver.recv())

    with anyio.fail_after(_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for frame in frames:
                await sender.send(frame)  # waits while the reader catches up
    assert received == frames


@pytest.mark.anyio
async def test_a_frame_written_a_byte_at_a_time_is_read_whole(tmp_path: Path) -> None:
    receiver = StreamReceiver(_address(tmp_path))
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        raw.connect(f"{tmp_path}/pipe")
        data = struct.pack("<I", 5) + b"hello" + struct.pack("<I", 2) + b"ok"
        for i, byte in enumerate(data):
            assert receiver.recv_nowait() is None  # nothing whole yet
            raw.sendall(bytes([byte]))
            if i == 8:  # the first frame's last byte
                with anyio.fail_after(_TIMEOUT_S):
                    assert await receiver.recv() == b"hello"
        with anyio.fail_after(_TIMEOUT_S):
            assert await receiver.recv() == b"ok"
    finally:
        raw.close()
        receiver.close()


def test_an_unbounded_sender_never_blocks_and_keeps_the_order(tmp_path: Path, pipes: Pipes) -> None:
    receiver = pipes.receiver(_address(tmp_path))
    sender = pipes.sender(_address(tmp_path))  # no hwm: the client's input pipe
    frames = _frames() * 3  # ~10 MB, far past the socket buffer: nobody reads meanwhile
    for frame in frames:
        assert sender.send_nowait(frame)
    assert any(t.name == "EngineCore-pipe-writer" for t in threading.enumerate())
    assert _read_all_sync(receiver, len(frames)) == frames


def test_a_bounded_sender_refuses_frames_once_the_reader_is_that_far_behind(
    tmp_path: Path, pipes: Pipes
) -> None:
    receiver = pipes.receiver(_address(tmp_path))
    sender = pipes.sender(_address(tmp_path), hwm=1)
    assert isinstance(sender, StreamSender)
    sndbuf = sender._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    frame = b"y" * 1000
    taken = 0
    while sender.send_nowait(frame):
        taken += 1
        assert taken * len(frame) <= 2 * sndbuf, "the pipe took more than its buffers hold"
    assert taken > 10
    # Reading makes room: the frame taken last (maybe in part) is finished, then more go.
    received: list[bytes] = []
    while len(received) < taken:
        sender._flush_nowait()
        if receiver.poll(0.01) and (frame_read := receiver.recv_nowait()) is not None:
            received.append(frame_read)
    assert not sender.needs_flush
    assert sender.send_nowait(b"after")
    received.extend(_read_all_sync(receiver, 1))
    assert received == [frame] * taken + [b"after"]


@pytest.mark.anyio
async def test_an_async_send_waits_for_the_reader(tmp_path: Path, pipes: Pipes) -> None:
    receiver = pipes.receiver(_address(tmp_path))
    sender = pipes.sender(_address(tmp_path), hwm=1)
    frame = b"z" * 4096
    while sender.send_nowait(frame):
        pass
    sent = anyio.Event()

    async def send_one_more() -> None:
        await sender.send(b"last")
        sent.set()

    with anyio.fail_after(_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send_one_more)
            await anyio.wait_all_tasks_blocked()
            assert not sent.is_set()  # the pipe is full and nobody reads
            while (received := await receiver.recv()) != b"last":
                assert received == frame
    assert sent.is_set()


def _die_mid_frame(path: str) -> None:
    """A process that sends a whole frame and half of the next, then is killed."""
    script = (
        "import os, signal, socket, struct\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.connect({path!r})\n"
        "s.sendall(struct.pack('<I', 3) + b'one' + struct.pack('<I', 1000) + b'half')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    process = subprocess.run([sys.executable, "-c", script], timeout=_TIMEOUT_S)
    assert process.returncode == -9


@pytest.mark.anyio
async def test_a_peer_dying_mid_frame_leaves_the_whole_frames_and_the_posts(
    tmp_path: Path, pipes: Pipes, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = pipes.receiver(_address(tmp_path), postable=True)
    await anyio.to_thread.run_sync(_die_mid_frame, f"{tmp_path}/pipe")
    with anyio.fail_after(_TIMEOUT_S):
        assert await receiver.recv() == b"one"
    assert receiver.recv_nowait() is None  # the half frame is dropped, the end is seen
    assert "mid-frame: 8 bytes dropped" in caplog.text
    assert isinstance(receiver, StreamReceiver) and not receiver.connected
    # A reader waiting on a pipe whose peer is gone still wakes for a post.
    received: list[bytes] = []

    async def read() -> None:
        received.append(await receiver.recv())

    with anyio.fail_after(_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            threading.Thread(target=receiver.post, args=(b"death notice",)).start()
    assert received == [b"death notice"]


@pytest.mark.anyio
async def test_posts_from_other_threads_wake_a_waiting_reader(tmp_path: Path, pipes: Pipes) -> None:
    receiver = pipes.receiver(_address(tmp_path), postable=True)
    sender = pipes.sender(_address(tmp_path), hwm=1)
    got: list[bytes] = []
    with anyio.fail_after(_TIMEOUT_S):
        for i in range(20):
            threading.Thread(target=receiver.post, args=(f"post {i}".encode(),)).start()
            got.append(await receiver.recv())
        assert sender.send_nowait(b"from the peer")
        got.append(await receiver.recv())
    assert got == [f"post {i}".encode() for i in range(20)] + [b"from the peer"]
    assert receiver.recv_nowait() is None
    assert not receiver.poll(0)  # the wake-up was taken with the last post


def test_a_sender_to_a_peer_that_is_gone_drops_its_frames(tmp_path: Path, pipes: Pipes) -> None:
    receiver = pipes.receiver(_address(tmp_path))
    bounded: Sender = pipes.sender(_address(tmp_path), hwm=1)
    assert receiver.poll(_TIMEOUT_S)  # the connection
    assert receiver.recv_nowait() is None
    receiver.close()
    for _ in range(3):  # as ZMQ does: nothing raises, nothing blocks
        assert bounded.send_nowait(b"x" * 100_000)
    assert bounded.send_blocking(b"y", timeout_s=0.1)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_closing_leaves_no_descriptor_or_thread_open(tmp_path: Path) -> None:
    before_fds, before_threads = _open_fds(), set(threading.enumerate())
    opened = Pipes()
    address = _address(tmp_path, uuid.uuid4().hex)
    receiver = opened.receiver(address, postable=True)
    sender = opened.sender(address)
    for _ in range(5):
        sender.send_nowait(b"w" * 1_000_000)  # a writer thread holds what the socket cannot
    receiver.post(b"p")
    assert receiver.recv_nowait() == b"p"
    opened.close()
    assert _open_fds() == before_fds
    assert set(threading.enumerate()) - before_threads == set()


def test_zmq_pipes_share_the_interface(pipes: Pipes) -> None:
    address = f"inproc://{uuid.uuid4().hex}"
    receiver = pipes.receiver(address, hwm=2, postable=True)
    sender = pipes.sender(address, hwm=2)
    assert receiver.endpoint == address
    assert sender.send_nowait(b"a")
    receiver.post(b"b")
    assert sorted(_read_all_sync(receiver, 2)) == [b"a", b"b"]
    while sender.send_nowait(b"c"):  # two messages each side, then no room
        pass
    assert not sender.needs_flush
    assert receiver.recv_nowait() == b"c"


def test_a_round_trip_under_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    assert uvloop  # the engine-core process serves asyncio on uvloop where installed

    async def round_trip() -> list[bytes]:
        opened = Pipes()
        try:
            receiver = opened.receiver(_address(tmp_path), postable=True)
            sender = opened.sender(_address(tmp_path), hwm=1)
            got: list[bytes] = []
            for frame in _frames():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, frame)
                    got.append(await receiver.recv())
            threading.Thread(target=receiver.post, args=(b"posted",)).start()
            got.append(await receiver.recv())
            return got
        finally:
            opened.close()

    got = anyio.run(round_trip, backend="asyncio", backend_options={"use_uvloop": True})
    assert got == [*_frames(), b"posted"]
