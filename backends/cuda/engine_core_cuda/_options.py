"""The CUDA backend's ``backend_options``, validated once at construction (no torch import)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from engine_core.config import EngineConfig

__all__ = [
    "DEVICE_ENV",
    "KERNEL_IMPLS",
    "CPU_DEFAULT_KV_CACHE_BYTES",
    "LOAD_FORMATS",
    "CudaOptions",
    "KVOffloadOptions",
    "parse_kv_offload",
    "parse_options",
    "requested_device",
]

KERNEL_IMPLS = ("triton", "torch")
LOAD_FORMATS = ("safetensors", "dummy")

DEVICE_ENV = "ENGINE_CORE_CUDA_DEVICE"
"""Environment variable naming the device used when ``backend_options`` has no ``device``
(``"cuda"``, ``"cuda:1"``, ``"cpu"``); default ``"cuda"``."""


def requested_device(config: EngineConfig | None) -> str:
    """The device a config asks for: ``backend_options["device"]``, else the environment's
    default, else ``"cuda"``."""
    options: dict[str, Any] = config.backend_options if config is not None else {}
    device = options.get("device")
    if device is None:
        device = os.environ.get(DEVICE_ENV) or "cuda"
    return str(device)


CPU_DEFAULT_KV_CACHE_BYTES = 512 << 20
"""KV cache size on the CPU when ``kv_cache_bytes`` is not given (the CPU path is for tests and
debugging, so it does not claim the machine's memory)."""
DEFAULT_MAX_GRAPH_BATCH_SIZE = 512

OPTION_NAMES = frozenset(
    {
        "device",
        "kernels",
        "cuda_graphs",
        "max_graph_batch_size",
        "kv_cache_bytes",
        "profile_dir",
        "load_format",
        "distributed_backend",
        "cpu_threads",
        "kv_offload",
    }
)


@dataclass(frozen=True, slots=True)
class CudaOptions:
    """Parsed ``backend_options``.

    - ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (default: the ``ENGINE_CORE_CUDA_DEVICE``
      environment variable, else ``"cuda"``);
    - ``kernels``: ``"triton"`` (the Triton kernels: paged attention, KV write, norms, rotary
      embedding, activation; the default on a GPU) or ``"torch"`` (plain torch: the references,
      with attention batched over decode rows; the default on the CPU, where Triton is
      interpreted);
    - ``cuda_graphs``: capture decode steps in CUDA graphs (default True; GPU and Triton kernels
      only);
    - ``max_graph_batch_size``: largest decode batch captured (default ``min(max_num_seqs, 512)``);
    - ``kv_cache_bytes``: bytes to give the KV cache instead of measuring free memory;
    - ``profile_dir``: where :meth:`~engine_core_cuda.CudaBackend.profile` writes traces (default
      ``./engine_core_profiles``);
    - ``load_format``: ``"safetensors"`` (default) or ``"dummy"`` (random weights of the
      ``config.json`` geometry, for benchmarks; no weight files needed);
    - ``distributed_backend``: the tensor-parallel collectives, ``"nccl"`` (default on CUDA) or
      ``"gloo"`` (the CPU's; on CUDA it lets two ranks share one GPU, for correctness checks);
    - ``cpu_threads``: torch's intra-op threads on the CPU (None: ``OMP_NUM_THREADS`` when set,
      else the usable cores less one, at least 1; under tensor parallelism per rank: see
      :func:`engine_core_cuda._device.resolve_cpu_threads`);
    - ``kv_offload``: the host KV tier's settings (``deadline_s``, a test ``fault``), read when
      ``kv_offload_bytes`` turns the tier on: see :mod:`engine_core_cuda._kv_offload`.
    """

    device: str
    kernels: Literal["triton", "torch"]
    cuda_graphs: bool
    max_graph_batch_size: int
    kv_cache_bytes: int | None
    profile_dir: str
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    distributed_backend: Literal["nccl", "gloo"] | None = None
    cpu_threads: int | None = None

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"backend_options[{name!r}] must be an int > 0, got {value!r}")
    return value


_KV_FAULT_KINDS = ("drop", "raise")


@dataclass(frozen=True, slots=True)
class KVOffloadOptions:
    deadline_s: float = 10.0
    fault_kind: str | None = None
    fault_probability: float = 0.0
    fault_seed: int = 0
    copy: str | None = None
    """``"batched"`` or ``"per_block"`` (None: batched on a GPU, per block on the CPU)."""


def parse_kv_offload(value: Any) -> KVOffloadOptions:
    """Validate ``backend_options["kv_offload"]`` (None: the defaults)."""
    if value is None:
        return KVOffloadOptions()
    if not isinstance(value, dict):
        raise ValueError(f"backend_options['kv_offload'] must be a dict, got {value!r}")
    unknown = sorted(set(value) - {"deadline_s", "fault", "copy"})
    if unknown:
        raise ValueError(
            f"backend_options['kv_offload'] has unknown key(s) {unknown}; known: copy, "
            "deadline_s, fault"
        )
    copy = value.get("copy")
    if copy not in (None, "batched", "per_block"):
        raise ValueError(
            f"backend_options['kv_offload']['copy'] must be 'batched' or 'per_block', got {copy!r}"
        )
    deadline = value.get("deadline_s", 10.0)
    if (
        not isinstance(deadline, (int, float))
        or isinstance(deadline, bool)
        or not 0 < deadline < float("inf")
    ):
        raise ValueError(
            f"backend_options['kv_offload']['deadline_s'] must be a number > 0, got {deadline!r}"
        )
    fault = value.get("fault")
    if fault is None:
        return KVOffloadOptions(float(deadline), copy=copy)
    if not isinstance(fault, dict) or fault.get("kind") not in _KV_FAULT_KINDS:
        raise ValueError(
            "backend_options['kv_offload']['fault'] must be a dict with 'kind' "
            f"({', '.join(_KV_FAULT_KINDS)}), 'probability' and 'seed', got {fault!r}"
        )
    extra = sorted(set(fault) - {"kind", "probability", "seed"})
    if extra:
        raise ValueError(f"backend_options['kv_offload']['fault'] has unknown key(s) {extra}")
    probability = fault.get("probability", 1.0)
    if not isinstance(probability, (int, float)) or not 0 <= probability <= 1:
        raise ValueError(
            "backend_options['kv_offload']['fault']['probability'] must be in [0, 1], "
            f"got {probability!r}"
        )
    seed = fault.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(
            f"backend_options['kv_offload']['fault']['seed'] must be an int, got {seed!r}"
        )
    return KVOffloadOptions(float(deadline), fault["kind"], float(probability), seed, copy)


def parse_options(config: EngineConfig) -> CudaOptions:
    """Validate ``config.backend_options`` (unknown names raise ``ValueError``)."""
    options = dict(config.backend_options)
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise ValueError(
            f"unknown cuda backend_options {unknown}; known: {', '.join(sorted(OPTION_NAMES))}"
        )
    device = requested_device(config)
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(
            f"backend_options['device'] must be 'cuda', 'cuda:N' or 'cpu', got {device!r}"
        )
    # On the CPU Triton is interpreted (several times slower than the torch path).
    kernels = options.get("kernels", "torch" if device == "cpu" else "triton")
    if kernels not in KERNEL_IMPLS:
        raise ValueError(
            f"backend_options['kernels'] must be one of {', '.join(KERNEL_IMPLS)}, got {kernels!r}"
        )
    cuda_graphs = options.get("cuda_graphs", True)
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"backend_options['cuda_graphs'] must be a bool, got {cuda_graphs!r}")
    max_graph = options.get("max_graph_batch_size")
    max_graph = (
        min(config.max_num_seqs, DEFAULT_MAX_GRAPH_BATCH_SIZE)
        if max_graph is None
        else _positive_int("max_graph_batch_size", max_graph)
    )
    kv_bytes = options.get("kv_cache_bytes")
    if kv_bytes is not None:
        kv_bytes = _positive_int("kv_cache_bytes", kv_bytes)
    profile_dir = options.get("profile_dir", "engine_core_profiles")
    if not isinstance(profile_dir, str) or not profile_dir:
        raise ValueError(f"backend_options['profile_dir'] must be a path, got {profile_dir!r}")
    load_format = options.get("load_format", "safetensors")
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"backend_options['load_format'] must be one of {', '.join(LOAD_FORMATS)}, "
            f"got {load_format!r}"
        )
    distributed = options.get("distributed_backend")
    if distributed not in (None, "nccl", "gloo"):
        raise ValueError(
            f"backend_options['distributed_backend'] must be 'nccl' or 'gloo', got {distributed!r}"
        )
    if distributed == "nccl" and device == "cpu":
        raise ValueError("backend_options['distributed_backend'] 'nccl' needs a CUDA device")
    cpu_threads = options.get("cpu_threads")
    if cpu_threads is not None:
        cpu_threads = _positive_int("cpu_threads", cpu_threads)
    parse_kv_offload(options.get("kv_offload"))  # checked here, used by the host KV tier
    return CudaOptions(
        device=device,
        kernels=kernels,
        cuda_graphs=cuda_graphs,
        max_graph_batch_size=max_graph,
        kv_cache_bytes=kv_bytes,
        profile_dir=profile_dir,
        load_format=load_format,
        distributed_backend=distributed,
        cpu_threads=cpu_threads,
    )
