"""Socket addresses of one client / engine-core pair.

By default the sockets are ``ipc://`` paths in a private temporary directory (mode 0700, so other
users cannot connect), removed when the client shuts down. With ``transport="tcp"`` they bind
``host`` (127.0.0.1 unless told otherwise) on ports the OS picks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Literal

__all__ = ["Transport", "SocketAddresses"]

Transport = Literal["ipc", "tcp"]


class SocketAddresses:
    """Where the client's output socket and the engine's input socket bind.

    ``output`` and ``input`` are bind addresses (``tcp://host:*`` picks a free port; the bound
    endpoint is read back from the socket). ``wake`` is an in-process address the client's
    output socket also binds, for messages from its own process watch.
    """

    def __init__(self, transport: Transport = "ipc", host: str = "127.0.0.1") -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.transport = transport
        self.directory: str | None = None
        if transport == "ipc":
            self.directory = tempfile.mkdtemp(prefix="engine-core-")
            os.chmod(self.directory, 0o700)  # mkdtemp's default; stated, not assumed
            self.output = f"ipc://{self.directory}/output"
            self.input = f"ipc://{self.directory}/input"
        else:
            self.output = f"tcp://{host}:*"
            self.input = f"tcp://{host}:*"
        self.wake = f"inproc://engine-core-wake-{uuid.uuid4().hex}"

    def remove(self) -> None:
        """Delete the private directory (idempotent)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
