"""The device and dtype the backend runs with, how much memory the device has free, and how many
threads torch computes with on the CPU.

On the CPU the Triton kernels run in interpreter mode, which must be switched on before the
kernel module is first imported: :func:`prepare_triton` does that.

**CPU threads.** torch's intra-op threads default to every core, and they spin and wait for one
another at each operation: when anything else wants a core (the engine's event loop, the HTTP
front end, other jobs on a shared machine) one descheduled thread holds up the whole operation,
and a step takes several times longer than on one thread. So the backend sizes them to what the
machine leaves (:func:`resolve_cpu_threads`): ``backend_options["cpu_threads"]`` when given,
else ``OMP_NUM_THREADS`` when the user set it, else the usable cores (affinity and cgroup quota)
less one for the engine's own threads, never below one; divided among tensor-parallel ranks.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from engine_core.config import backend_options_hint
from engine_core_cuda.kernels import KERNEL_MODULES

__all__ = [
    "CpuThreads",
    "apply_cpu_threads",
    "free_memory_bytes",
    "prepare_triton",
    "resolve_cpu_threads",
    "resolve_device",
    "resolve_dtype",
    "usable_cpus",
]

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
                f"{backend_options_hint({'device': 'cpu'})} runs on the CPU"
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
            f"{backend_options_hint({'kernels': 'torch'})}"
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


def _cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole CPUs the cgroup (v2) quota allows, rounded up; None without a quota."""
    try:
        with open(path, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return max(1, min(count, limit) if limit is not None else count)


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """torch's intra-op thread count on the CPU and where it came from."""

    threads: int
    source: str
    """``"cpu_threads"`` (the option), ``"OMP_NUM_THREADS"`` or ``"N cores - 1"`` (the
    default; ``"N cores - 1, over R ranks"`` under tensor parallelism)."""

    def describe(self) -> str:
        return f"{self.threads} ({self.source})"


def resolve_cpu_threads(
    option: int | None, tp_size: int = 1, environ: dict[str, str] | None = None
) -> CpuThreads:
    """Threads for one rank: ``option`` (``backend_options["cpu_threads"]``) when given; else
    ``OMP_NUM_THREADS`` when set to a positive integer (the user's word, as torch itself reads
    it); else :func:`usable_cpus` less one (the engine's event loop, the front end), divided by
    ``tp_size``, at least 1."""
    if option is not None:
        return CpuThreads(option, "cpu_threads")
    env = os.environ if environ is None else environ
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return CpuThreads(int(omp), "OMP_NUM_THREADS")
    cores = usable_cpus()
    source = f"{cores} cores - 1" + (f", over {tp_size} ranks" if tp_size > 1 else "")
    return CpuThreads(max(1, (cores - 1) // max(1, tp_size)), source)


def apply_cpu_threads(threads: int) -> None:
    """Make torch compute with ``threads`` intra-op threads on the calling thread (OpenMP's
    count is per thread: threads that ran torch before keep theirs until told) and on threads
    started later."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
