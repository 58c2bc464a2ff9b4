"""The device and dtype the backend runs with, and how much memory the device has free.

On the CPU the Triton kernels run in interpreter mode, which must be switched on before the
kernel module is first imported: :func:`prepare_triton` does that.
"""

from __future__ import annotations

import os
import sys

import torch

from engine_core_cuda.kernels import KERNEL_MODULES

__all__ = ["free_memory_bytes", "prepare_triton", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a torch device, checking that it exists."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {name!r}: torch sees no CUDA device (torch {torch.__version__}); "
                "backend_options={'device': 'cpu'} runs on the CPU"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``EngineConfig.dtype``: ``"auto"`` is bfloat16 on a GPU and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = _DTYPES.get(name.lower().removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {name!r}")
    return dtype


def _triton_interprets() -> bool | None:
    """Whether the imported Triton runs its own library functions interpreted (None: Triton is
    not imported yet). The mode is fixed when ``triton`` is first imported."""
    if "triton" not in sys.modules:
        return None
    import triton.language as tl

    return type(tl.cdiv).__name__ == "InterpretedFunction"


def prepare_triton(device: torch.device) -> None:
    """Switch Triton to interpreter mode for a CPU device, before Triton and the kernels are
    imported.

    Raises ``RuntimeError`` when Triton (or the kernels) was already imported in the other mode
    in this process, e.g. by transformers: the mode of every ``triton.jit`` function, Triton's
    own included, is fixed at import."""
    if device.type != "cpu":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    kernels_compiled = any(
        not getattr(sys.modules[m], "INTERPRETED", True) for m in KERNEL_MODULES if m in sys.modules
    )
    if _triton_interprets() is False or kernels_compiled:
        raise RuntimeError(
            "Triton was imported in this process before TRITON_INTERPRET=1 was set, so its "
            "kernels cannot run on the CPU; set TRITON_INTERPRET=1 in the environment (or "
            "create the backend before importing anything that imports triton), or use "
            "backend_options={'kernels': 'torch'}"
        )


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the GPU's free memory, or the machine's available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
