"""The ``"pd"`` connector between hosts: a prefill engine serves its exported blocks over
authenticated ZMQ, a decode engine on another machine pulls them (``docs/disaggregation.md``).

Same-host handoffs read the prefill engine's handoff segment directly (shared memory, see
``engine_core._core.pd_connector``). A reader on another machine cannot, so each engine of a
disaggregated deployment also runs a :class:`PDServer`: a thread with a ZMQ ``ROUTER`` socket
on TCP that answers for its handoff segment, with the same rules as a same-host reader:

- ``read`` (slot, epoch, blocks): if ``ready[slot]`` carries the epoch, stamp ``renew[slot]``,
  read the blocks (the segment's ``contents`` words, and the bytes of the backend's reader when
  it registered one), then check ``ready`` again: only a read that began and ended while the
  export was published is answered ``ok`` (the blocks were held the whole time); otherwise the
  answer is a refusal and the reader recomputes. It never returns freed blocks.
- ``renew`` (slot, epoch): the reader is still copying: ``renew[slot]`` is stamped on the
  prefill host's own clock (clocks of two machines are never compared).
- ``done`` (slot, epoch): the reader is finished with the export (read, failed, cancelled):
  the prefill engine frees the blocks at its next step, as a same-host confirmation does.

Authentication reuses the deployment scheme of remote engines (``pipes.addresses``): ZMQ CURVE
with a key set made by the data-parallel client for the deployment (:func:`deployment_keys`),
given to each engine with its configuration (``kv_connector_options["pd_keys"]``, over the
engine's private or CURVE-encrypted startup pipe); servers admit only the deployment's client
key (a ZAP handler). A peer with other keys never completes the handshake: its reads are
refused (counted ``pd_auth_refused``) and it recomputes.

:class:`PDClient` is the dialing side (decode engines, and the front end for releases): one
``DEALER`` socket per prefill engine, with a monitor that reports a refused handshake or a
dropped connection (a prefill engine that died): pending reads there fail at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from engine_core._core.pd_connector import HandoffSegment, attach
from engine_core._engine.pipes.addresses import (
    DeploymentKeys,
    admit_only,
    curve_client,
    curve_server,
    make_socket,
)
from engine_core.config import EngineConfig

__all__ = [
    "KEYS_OPTION",
    "PDClient",
    "PDRemote",
    "PDServer",
    "keys_from_options",
    "remote_release",
]

logger = logging.getLogger(__name__)

KEYS_OPTION = "pd_keys"
"""``kv_connector_options`` key of the deployment's transfer keys (set by the data-parallel
client for each engine; never user-facing)."""
READ, RENEW, DONE = "read", "renew", "done"
OK, NOT_YET, REFUSED = 0, 1, 2
"""A read's answer: done; the export is not published yet (ask again); refused (given up,
freed, or never an export of this engine: recompute)."""
_POLL_MS = 100
"""How often the server thread looks whether it should stop."""
_GONE_EVENTS = zmq.EVENT_DISCONNECTED
_REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

_encode = msgspec.msgpack.encode
_decode_request = msgspec.msgpack.Decoder(tuple[int, str, int, int, list[list[int]]]).decode
_decode_reply = msgspec.msgpack.Decoder(tuple[int, int, list[int]]).decode

PayloadReader = Callable[[list[list[int]]], bytes]
"""A backend's reader of block bytes (per KV-cache group, device block ids; -1: none)."""


def keys_from_options(options: dict[str, Any]) -> DeploymentKeys | None:
    """The deployment's transfer keys in ``kv_connector_options`` (None: not given)."""
    raw = options.get(KEYS_OPTION)
    if raw is None:
        return None
    if isinstance(raw, DeploymentKeys):
        return raw
    return msgspec.convert(raw, DeploymentKeys)


def _advertised_host(bind: str, toward: str | None = None) -> str:
    """The address readers dial: the bound one, or for a wildcard bind this host's address on
    the route toward ``toward`` (the driver), else on its default route (a UDP socket's
    ``connect`` sends nothing), else what its name resolves to."""
    if bind not in ("0.0.0.0", "*", ""):
        return bind
    for target in (toward, "10.254.254.254"):
        if not target:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                address = str(probe.getsockname()[0])
        except OSError:
            continue
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PDServer:
    """Serves one engine's handoff segment over CURVE-authenticated ZMQ (see the module)."""

    def __init__(
        self,
        segment: str,
        keys: DeploymentKeys,
        *,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        payload: PayloadReader | None = None,
    ) -> None:
        self.segment_name = segment
        """The handoff segment served (created by the scheduler half, attached at the first
        request: the worker half, and so this server, start before it)."""
        self._segment: HandoffSegment | None = None
        self.payload = payload
        self.reads = 0
        self.refused_reads = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth = admit_only(self._ctx, keys.client_public)
        sock = make_socket(self._ctx, zmq.ROUTER)
        curve_server(sock, keys)
        host = "*" if bind_host in ("0.0.0.0", "*", "") else bind_host
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise_host or bind_host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="pd-server", daemon=True
        )
        self._thread.start()

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        continue
                    try:
                        rid, op, slot, epoch, blocks = _decode_request(frames[1])
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    reply = self._handle(op, slot, epoch, blocks)
                    if reply is not None:
                        ok, contents, payload = reply
                        sock.send_multipart([frames[0], _encode((rid, ok, contents)), payload])
        except zmq.ContextTerminated:
            pass
        except Exception:  # the transport must not take the engine down
            logger.exception("the pd transfer server failed")
        finally:
            sock.close(0)

    def _handle(
        self, op: str, slot: int, epoch: int, blocks: list[list[int]]
    ) -> tuple[int, list[int], bytes] | None:
        segment = self._segment
        if segment is None:
            segment = self._segment = attach(self.segment_name)
            if segment is None:
                return (REFUSED, [], b"") if op == READ else None
        if not 0 <= slot < segment.num_blocks:
            return (REFUSED, [], b"") if op == READ else None
        if op == DONE:
            segment.done[slot] = epoch
            return None
        if op == RENEW:
            if segment.ready[slot] == epoch:
                segment.renew[slot] = time.monotonic()
            return None
        if op != READ:
            return None
        n = segment.num_blocks
        ready = segment.ready[slot]
        if ready not in (epoch, -epoch) and segment.done[slot] != epoch:
            return NOT_YET, [], b""  # its engine publishes it at its next step
        if ready != epoch or any(not -1 <= b < n for ids in blocks for b in ids):
            self.refused_reads += 1
            return REFUSED, [], b""
        segment.renew[slot] = time.monotonic()
        contents = [int(segment.contents[b]) if b >= 0 else 0 for ids in blocks for b in ids]
        payload = self.payload(blocks) if self.payload is not None else b""
        # After the read: still published, so the blocks were held the whole time.
        if segment.ready[slot] != epoch:
            self.refused_reads += 1
            return REFUSED, [], b""
        self.reads += 1
        return OK, contents, payload

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        with contextlib.suppress(Exception):
            self._auth.stop()
        self._ctx.term()


class _Peer:
    __slots__ = ("sock", "monitor", "state")

    def __init__(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.monitor = monitor
        self.state = "connecting"
        """``connecting``, ``ok`` (a handshake completed), ``refused`` (the handshake failed:
        other keys), ``gone`` (the connection dropped after a handshake: the engine died)."""


class PDClient:
    """Dials prefill engines' :class:`PDServer` (see the module). One thread uses it."""

    def __init__(self, keys: DeploymentKeys) -> None:
        self._keys = keys.for_engine()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)
        self._replies: dict[int, tuple[int, list[int], bytes]] = {}
        self.auth_refused = 0
        """Handshakes a server refused (each counted once per connection attempt)."""
        self.renewed: dict[tuple[str, int, int], float] = {}
        """(address, slot, epoch) -> when this side last renewed (this host's clock)."""
        self._lock = threading.Lock()
        """The scheduler half and the worker half may run in two threads: one at a time."""

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            sock = make_socket(self._ctx, zmq.DEALER, linger_ms=500)
            curve_client(sock, self._keys)
            monitor = sock.get_monitor_socket(
                _GONE_EVENTS | _REFUSED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
            sock.connect(address)
            peer = self._peers[address] = _Peer(sock, monitor)
        return peer

    def send(
        self, address: str, op: str, slot: int, epoch: int, blocks: list[list[int]] | None = None
    ) -> int:
        """Send one request; returns its id (a ``read``'s answer: :meth:`take`)."""
        with self._lock:
            rid = next(self._ids)
            peer = self._peer(address)
            with contextlib.suppress(zmq.Again):  # a full queue to a dead peer: reads time out
                peer.sock.send(_encode((rid, op, slot, epoch, blocks or [])), zmq.NOBLOCK)
            if op == RENEW:
                self.renewed[address, slot, epoch] = time.monotonic()
            return rid

    def poll(self, timeout_ms: int = 0) -> None:
        """Take in answers and connection events (waiting up to ``timeout_ms`` for one)."""
        with self._lock:
            self._poll(timeout_ms)

    def _poll(self, timeout_ms: int) -> None:
        if timeout_ms > 0 and self._peers:
            poller = zmq.Poller()
            for peer in self._peers.values():
                poller.register(peer.sock, zmq.POLLIN)
                poller.register(peer.monitor, zmq.POLLIN)
            poller.poll(timeout_ms)
        for peer in self._peers.values():
            while True:
                try:
                    event = parse_monitor_message(peer.monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                kind = event["event"]
                if kind & _REFUSED_EVENTS:
                    peer.state = "refused"
                    self.auth_refused += 1
                elif kind & _GONE_EVENTS:
                    if peer.state == "connecting":
                        # Dropped before a handshake completed: the server could not
                        # authenticate this side (other server keys).
                        peer.state = "refused"
                        self.auth_refused += 1
                    elif peer.state != "refused":
                        peer.state = "gone"
                elif kind & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    peer.state = "ok"
            while True:
                try:
                    frames = peer.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    continue
                try:
                    rid, ok, contents = _decode_reply(frames[0])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                self._replies[rid] = (ok, contents, frames[1])

    def take(self, rid: int) -> tuple[int, list[int], bytes] | None:
        """The answer to request ``rid`` once it arrived (after :meth:`poll`)."""
        with self._lock:
            return self._replies.pop(rid, None)

    def wait(self, rid: int, timeout_s: float) -> tuple[int, list[int], bytes] | None:
        """The answer to request ``rid``, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.take(rid)
            left = deadline - time.monotonic()
            if answer is not None or left <= 0:
                return answer
            self.poll(timeout_ms=max(1, int(left * 1e3)))

    def state(self, address: str) -> str:
        peer = self._peers.get(address)
        return "connecting" if peer is None else peer.state

    def forget(self, address: str, slot: int, epoch: int) -> None:
        with self._lock:
            self.renewed.pop((address, slot, epoch), None)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for peer in self._peers.values():
            with contextlib.suppress(Exception):
                peer.sock.disable_monitor()
            peer.monitor.close(0)
            peer.sock.close()  # lingers for the last confirmations
        self._peers.clear()
        self._ctx.term()


def remote_release(client: PDClient | None, params: dict[str, Any] | None) -> bool:
    """Tell the prefill engine of ``params`` over ZMQ that nobody will read its export
    (the counterpart of ``pd_connector.release`` for another host)."""
    if client is None or not params or not params.get("address"):
        return False
    client.send(str(params["address"]), DONE, int(params["slot"]), int(params["epoch"]))
    return True


class PDRemote:
    """One engine's end of the transport: its server (for its exports) and its client (for its
    loads), registered with the scheduler half (``pd_connector.register_link``)."""

    def __init__(
        self,
        config: EngineConfig,
        segment: str,
        keys: DeploymentKeys,
        payload: PayloadReader | None = None,
    ) -> None:
        options = config.kv_connector_options
        default_bind = "0.0.0.0" if config.data_parallel_backend == "ray" else "127.0.0.1"
        bind = str(options.get("pd_host", default_bind))
        advertise = options.get("pd_advertise_host") or _advertised_host(
            bind, config.ray_driver_host
        )
        self.server = PDServer(
            segment,
            keys,
            bind_host=bind,
            advertise_host=str(advertise),
            payload=payload,
        )
        self.client = PDClient(keys)
        self.address = self.server.address
        self.addresses: list[str] = [self.address]
        """Every tensor-parallel rank's server, in rank order (set by rank 0's worker half)."""
        self.timeout_s = float(options.get("pd_timeout_s", 5.0))

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        segment: str,
        payload: PayloadReader | None = None,
    ) -> PDRemote | None:
        """The transport of an engine whose configuration carries the deployment's keys (None
        without them: other hosts then recompute)."""
        keys = keys_from_options(config.kv_connector_options)
        if keys is None or not zmq.has("curve"):
            return None
        return cls(config, segment, keys, payload)

    # -- what the scheduler half asks (pd_connector.RemoteLink) -------------------------------

    @property
    def auth_refused(self) -> int:
        return self.client.auth_refused

    def release(self, params: dict[str, Any]) -> None:
        remote_release(self.client, params)
        self.client.forget(str(params.get("address")), int(params["slot"]), int(params["epoch"]))

    def renewed_at(self, params: dict[str, Any]) -> float:
        key = (str(params.get("address")), int(params.get("slot", -1)), int(params.get("epoch", 0)))
        return self.client.renewed.get(key, 0.0)

    def close(self) -> None:
        self.server.close()
        self.client.close()
