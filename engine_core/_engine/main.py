"""The engine-core process around one :class:`EngineCoreProc`.

The process is a fresh interpreter running ``python -m engine_core._engine`` (see ``mp.launcher``),
so it never imports its parent's ``__main__``. :func:`main` reads its command line: the client's
output address, the input address to bind, and the descriptor of its end of a socket pair whose
other end the parent holds. :func:`run_engine_core` connects the output pipe, binds the input pipe
(see ``pipes``) and says :class:`~engine_core._engine.wire.Hello`; the client answers with the
configuration (:class:`~engine_core._engine.wire.Startup`, msgspec, nothing pickled). It then builds
the engine core (backend, KV spec, block count, allocation) in a worker thread, sends ``Ready`` and
serves, with a heartbeat while it has work (``engine_heartbeat_timeout_s``). Under asyncio it serves
on uvloop where installed, as the front end does (``runtime``): waking on a request costs a plain
asyncio loop ~20 us more. It exits by itself when its parent dies (its end of the pair reads
end-of-file), shuts down cleanly on SIGTERM or a ``Shutdown`` message, and reports a fatal error as
an ``EngineDead`` message before exiting with status 1.

An engine placed on another machine (by Ray, see ``ray.launch``) gets the deployment's CURVE
keys in its environment (``ENGINE_CORE_DIAL_KEYS``, removed at once, never on the command line):
it then dials the driver's two TCP sockets, its input socket included, as an authenticated CURVE
client.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import sys
import traceback

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import zmq

from engine_core._engine.core import EngineCore
from engine_core._engine.pipes.addresses import OUTPUT_HWM, EngineKeys
from engine_core._engine.pipes.pipes import Pipes, Receiver, Sender
from engine_core._engine.proc import EngineCoreProc
from engine_core._engine.runtime import run_options
from engine_core._engine.wire import EngineDead, EngineMessage, Hello, Ready, startup_decoder
from engine_core.config import EngineConfig

__all__ = [
    "DIAL_KEYS_ENV",
    "HEARTBEATS_PER_TIMEOUT",
    "PARENT_GONE_EXIT_CODE",
    "main",
    "run_engine_core",
]

logger = logging.getLogger(__name__)

_CONFIGURATION_ERRORS = (ValueError, TypeError, LookupError, FileNotFoundError, NotADirectoryError)
"""What a backend raises at startup for a configuration it cannot run (an unknown backend, a
bad option, a missing file): the client's error says it, no traceback needed."""

_OUTPUT_LINGER_MS = 2000
"""How long exiting waits for the last messages (the death notice) to leave."""
_LOCAL_SCHEMES = ("ipc://", "unix://")
"""Addresses that are paths in the client's private directory."""
PARENT_GONE_EXIT_CODE = 3
"""Exit status of an engine-core process whose parent died."""
HEARTBEATS_PER_TIMEOUT = 5
"""The engine looks whether a heartbeat is due this many times per
``engine_heartbeat_timeout_s``, so a live one is heard from at least every 2/5 of it."""
DIAL_KEYS_ENV = "ENGINE_CORE_DIAL_KEYS"
"""Environment variable with an :class:`EngineKeys` (JSON): the engine dials both of the
driver's sockets as a CURVE client."""
_USAGE = "usage: python -m engine_core._engine OUTPUT_ADDRESS INPUT_ADDRESS PARENT_FD"


def main(argv: list[str] | None = None) -> None:
    """``python -m engine_core._engine OUTPUT_ADDRESS INPUT_ADDRESS PARENT_FD``: what
    ``mp.launcher`` runs. Never returns."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[2].isdigit():
        print(_USAGE, file=sys.stderr)
        os._exit(2)
    dial_keys = os.environ.pop(DIAL_KEYS_ENV, None)  # not inherited by the engine's children
    keys = None if dial_keys is None else msgspec.json.decode(dial_keys, type=EngineKeys)
    run_engine_core(args[0], args[1], int(args[2]), dial_keys=keys)


def run_engine_core(
    output_address: str,
    input_address: str,
    parent_fd: int,
    *,
    dial_keys: EngineKeys | None = None,
) -> None:
    """The engine-core process: connect the output pipe to ``output_address``, bind the input
    pipe to ``input_address`` (with ``dial_keys``: connect it, both pipes CURVE clients), take
    the configuration from the client, serve; exit when the descriptor ``parent_fd`` reads
    end-of-file (the parent is gone). Never returns."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.set_inheritable(parent_fd, False)  # the engine's own children must not hold it open
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING,
            format="%(asctime)s engine-core[%(process)d] %(levelname)s %(name)s: %(message)s",
        )
    exit_code = 1
    pipes = Pipes(dial_keys)
    try:
        output = pipes.sender(output_address, hwm=OUTPUT_HWM, linger_ms=_OUTPUT_LINGER_MS)
        server = _Server(pipes, output, input_address, parent_fd)
        config = server.handshake()
        if config is not None:
            exit_code = anyio.run(server.serve, config, **run_options(config.engine_runtime))
    except BaseException:
        logger.exception("the engine-core process failed")
    finally:
        pipes.close()  # a ZMQ pipe lingers until the last messages are out
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: a model thread abandoned by the step timeout would keep the process
        # alive at interpreter shutdown.
        os._exit(exit_code)


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class _Server:
    """Startup handshake, signals and the final notice around one :class:`EngineCoreProc`."""

    def __init__(self, pipes: Pipes, output: Sender, input_address: str, parent_fd: int) -> None:
        self.pipes = pipes
        self.output = output
        self.input: Receiver | None = None
        self.input_address = input_address
        self.parent_fd = parent_fd
        self.config: EngineConfig  # set by serve()
        self.encoder = msgspec.msgpack.Encoder()
        self.proc: EngineCoreProc | None = None
        self.stop_reason: str | None = None
        self.startup_scope: anyio.CancelScope | None = None

    def handshake(self) -> EngineConfig | None:
        """Bind (or dial) the input pipe, say :class:`Hello` and wait for the configuration
        (None: the bind failed, reported to the client). Exits if the parent dies meanwhile."""
        try:
            self.input = input_ = self.pipes.receiver(self.input_address)
        except (zmq.ZMQError, OSError) as exc:
            self._die(self.output, exc)
            return None
        self._send(self.output, Hello(input_.endpoint))
        poller = zmq.Poller()
        poller.register(input_.pollable, zmq.POLLIN)
        poller.register(self.parent_fd, zmq.POLLIN)
        decoder = startup_decoder()
        while True:
            ready = dict(poller.poll())
            if self.parent_fd in ready:
                self._exit_parent_gone()
            if input_.pollable in ready and (frame := input_.recv_nowait()) is not None:
                try:
                    return decoder.decode(frame).config
                except Exception as exc:  # a client of another version, say
                    self._die(self.output, exc)
                    return None

    async def serve(self, config: EngineConfig) -> int:
        self.config = config
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._exit_when_parent_dies)
            tg.start_soon(self._watch_signals)
            assert self.input is not None
            exit_code = await self._serve(self.input, self.output)
            tg.cancel_scope.cancel()
        return exit_code

    async def _serve(self, input_: Receiver, output: Sender) -> int:
        core: EngineCore | None = None
        with anyio.CancelScope() as self.startup_scope:
            try:
                core = await anyio.to_thread.run_sync(
                    EngineCore, self.config, abandon_on_cancel=True
                )
            except Exception as exc:
                return self._die(output, exc, startup=True)
        self.startup_scope = None
        if core is None or self.stop_reason is not None:
            self._send(output, EngineDead(reason=f"stopped during startup by {self.stop_reason}"))
            return 0
        endpoint = input_.endpoint
        info = core.info
        logger.info("ready: %s, input at %s", info, endpoint)
        self._send(output, Ready(info, endpoint))
        heartbeat_timeout_s = self.config.engine_heartbeat_timeout_s
        proc = self.proc = EngineCoreProc(
            core,
            input_,
            output,
            step_timeout_s=self.config.step_timeout_s,
            heartbeat_interval_s=(
                heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT
                if heartbeat_timeout_s is not None and math.isfinite(heartbeat_timeout_s)
                else None
            ),
        )
        if self.stop_reason is not None:
            proc.request_shutdown(self.stop_reason)
        try:
            await proc.run()
        except Exception as exc:
            return self._die(output, exc)  # the backend may be mid-call: do not close it
        try:
            core.close()
        finally:
            self._send(output, EngineDead(reason=f"shut down by {proc.stop_reason}"))
        return 0

    def _send(self, output: Sender, message: EngineMessage) -> None:
        # Outside the serving loop (the handshake, the last notice): a client that stopped
        # reading holds it up for the linger time at most.
        output.send_blocking(self.encoder.encode(message), _OUTPUT_LINGER_MS / 1000)

    def _die(self, output: Sender, exc: BaseException, *, startup: bool = False) -> int:
        root = _root_cause(exc)
        if startup and isinstance(root, _CONFIGURATION_ERRORS):
            # The client reports it in one line (the traceback travels in the notice).
            logger.debug("the engine cannot start", exc_info=root)
        else:
            logger.error("fatal error", exc_info=root)
        self._send(
            output,
            EngineDead(
                reason=f"{type(root).__name__}: {root}",
                error_type=type(root).__name__,
                traceback="".join(traceback.format_exception(root)),
            ),
        )
        return 1

    async def _exit_when_parent_dies(self) -> None:
        await anyio.wait_readable(self.parent_fd)
        self._exit_parent_gone()

    def _exit_parent_gone(self) -> None:
        """Exit now that the parent is gone (its end of the pair closed), removing the private
        socket directory that the parent can no longer remove."""
        logger.warning("the parent process is gone: exiting")
        for scheme in _LOCAL_SCHEMES:
            if self.input_address.startswith(scheme):
                shutil.rmtree(os.path.dirname(self.input_address.removeprefix(scheme)), True)
        logging.shutdown()
        os._exit(PARENT_GONE_EXIT_CODE)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                logger.info("SIGTERM: shutting down")
                self.stop_reason = "SIGTERM"
                if self.proc is not None:
                    self.proc.request_shutdown("SIGTERM")
                elif self.startup_scope is not None:
                    self.startup_scope.cancel()
