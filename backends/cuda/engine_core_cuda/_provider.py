"""The entry point's object: answers "usable here?" without importing torch or triton."""

from __future__ import annotations

import glob
import os
from importlib.util import find_spec
from typing import TYPE_CHECKING

from engine_core.config import backend_options_hint
from engine_core_cuda._options import DEVICE_ENV, requested_device

if TYPE_CHECKING:
    from engine_core.abc import Backend
    from engine_core.config import EngineConfig

__all__ = ["CudaProvider", "cuda_device_present", "provider"]


def cuda_device_present() -> bool:
    """Whether an NVIDIA GPU is visible to this process, judged from the driver's device files
    (no CUDA initialization, no torch import)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


class CudaProvider:
    """Says whether the CUDA backend can run here and imports it when asked."""

    name = "cuda"
    install_hint = "pip install engine-core-cuda"
    fallback_options = {"device": "cpu"}
    """Where no GPU is present the backend still runs, on the CPU."""

    def is_available(self, config: EngineConfig | None = None) -> tuple[bool, str]:
        """Usable when torch and triton are installed and either a CUDA device is present or
        the device asked for (``config.backend_options["device"]``, else the
        ``ENGINE_CORE_CUDA_DEVICE`` environment variable) is the CPU."""
        missing = [name for name in ("torch", "triton") if find_spec(name) is None]
        if missing:
            return (
                False,
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed",
            )
        if requested_device(config).startswith("cpu"):
            return True, "CPU (torch CPU tensors, Triton interpreter)"
        if cuda_device_present():
            return True, "CUDA GPU (torch + Triton)"
        return False, (
            f"no CUDA device found; {backend_options_hint(self.fallback_options)} (or "
            f"{DEVICE_ENV}=cpu) runs this backend on the CPU"
        )

    def load(self) -> type[Backend]:
        """The :class:`~engine_core_cuda.CudaBackend` class."""
        from engine_core_cuda._backend import CudaBackend

        return CudaBackend

    def __repr__(self) -> str:
        return "CudaProvider()"


provider = CudaProvider()
