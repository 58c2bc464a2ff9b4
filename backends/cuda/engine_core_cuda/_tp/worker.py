"""A tensor-parallel worker (ranks 1..N-1), run as ``python -m engine_core_cuda._tp.worker`` by
rank 0's :class:`~engine_core._workers.WorkerGroup`. It holds a
:class:`~engine_core_cuda.CudaBackend` for its rank, runs every step rank 0 broadcasts (the same
forward pass, joining the collectives) and never samples: right after its forward pass it joins
rank 0's broadcast of the step's sampled ids, device to device on the step's stream, and writes
them into its persistent rows, where the next step gathers its input ids (as at TP=1). So the
host never needs them: under async scheduling step n+1 is launched before step n's ids reach
rank 0's host, and each rank's stream orders the broadcast before step n+1's inputs."""

from __future__ import annotations

import json

import msgspec
import torch

from engine_core._workers import Sampled, Step, serve
from engine_core._workers.messages import Scalar
from engine_core.config import EngineConfig
from engine_core.kv_connector import KVConnectorLayout
from engine_core_cuda._backend import CudaBackend

__all__ = ["CudaWorker"]


class CudaWorker:
    def __init__(self, config: EngineConfig, rank: int, size: int, directory: str) -> None:
        self.config = config
        self.rank = rank
        self.directory = directory
        self.backend: CudaBackend | None = None

    def _backend(self) -> CudaBackend:
        if self.backend is None:
            raise RuntimeError("the worker has not loaded its model")
        return self.backend

    def step(self, step: Step) -> None:
        backend = self._backend()
        runner = backend.runner
        backend.execute_model(step.scheduler_output)
        inputs = runner.skip_sampling()
        if inputs is not None:
            with torch.inference_mode():
                runner.receive_tokens(inputs)
        backend.kv_connector_report()  # joins rank 0's agreement on what finished

    def sampled(self, sampled: Sampled) -> None:
        raise RuntimeError("the CUDA workers receive the sampled ids by broadcast, not by message")

    def call(self, method: str, args: list[Scalar]) -> Scalar:
        if method == "load":
            self.backend = CudaBackend(self.config, tp_rank=self.rank, tp_directory=self.directory)
            return None
        backend = self._backend()
        if method == "available_kv_cache_memory":
            return backend.available_kv_cache_memory()
        if method == "initialize_kv_cache":
            assert isinstance(args[0], int)
            groups = args[1] if len(args) > 1 else None
            backend.initialize_kv_cache(
                args[0], json.loads(groups) if isinstance(groups, str) else None
            )
        elif method == "add_lora":
            from engine_core.lora import LoRARequest

            name, path = str(args[1]), str(args[2])
            assert isinstance(args[0], int)
            backend.add_lora(LoRARequest(name, args[0], path))
        elif method == "remove_lora":
            assert isinstance(args[0], int)
            backend.remove_lora(args[0])
        elif method == "init_kv_connector":
            assert isinstance(args[0], str) and isinstance(args[1], str)
            layout = msgspec.json.decode(args[1], type=KVConnectorLayout)
            backend.init_kv_connector(args[0], layout)
        elif method == "init_pd":  # the "pd" connector's worker half of this rank
            from engine_core_cuda._pd_transfer import layout_from_text

            assert isinstance(args[0], str) and isinstance(args[1], str)
            return str(backend.init_pd_rank(layout_from_text(args[0]), args[1]).address)
        elif method == "profile":
            backend.profile("start" if args[0] == "start" else "stop")
        elif method == "sleep":
            backend.sleep(int(args[0]) if isinstance(args[0], int) else 1)
        elif method == "wake_up":
            backend.wake_up()
        elif method == "close":
            backend.close()
        else:
            raise ValueError(f"unknown worker call {method!r}")
        return None


if __name__ == "__main__":
    serve(CudaWorker)
