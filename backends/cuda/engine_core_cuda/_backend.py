"""``CudaBackend``: the engine core's view of the model runner.

Startup follows the core's handshake: the constructor loads the model (weights, tokenizer files
checked); :meth:`CudaBackend.kv_cache_spec` reports the KV geometry;
:meth:`CudaBackend.available_kv_cache_memory` runs the profiling pass and reports the bytes the
KV cache may take; :meth:`CudaBackend.initialize_kv_cache` allocates it and captures the decode
CUDA graphs.

With ``tensor_parallel_size`` N > 1 this object is rank 0: it starts ranks 1..N-1 as worker
processes (:mod:`engine_core_cuda._tp`), broadcasts each step to them, and only it samples; the
sampled ids reach the workers by a device broadcast, so async scheduling works as at TP=1.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from engine_core.abc import (
    AsyncModelRunnerOutput,
    Backend,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LayerSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    SlidingWindowSpec,
    SpecSupport,
)
from engine_core.config import EngineConfig
from engine_core.kv_connector import KVConnectorLayout, KVConnectorReport, KVConnectorWorker
from engine_core.lora import LoRAError, LoRARequest, LoRASupport
from engine_core_cuda._cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine_core_cuda._hf_config import load_model_config
from engine_core_cuda._kv_layout import KVLayout
from engine_core_cuda._lora import served_modules
from engine_core_cuda._memory import available_kv_cache_memory, graph_max_batch_size
from engine_core_cuda._model_runner import ModelRunner
from engine_core_cuda._options import parse_options
from engine_core_cuda._tp.coordinator import Coordinator, join, rank_options
from engine_core_cuda._tp.parallel import TensorParallel, share_cpu
from engine_core_cuda._tp.shard import shard_model_config

__all__ = ["CudaBackend"]

logger = logging.getLogger(__name__)


def _check_model_dir(config: EngineConfig, load_format: str) -> Path:
    """The model directory, checked for the files startup needs (``FileNotFoundError`` naming
    the missing one): ``config.json``, and ``tokenizer.json`` when the tokenizer comes from the
    model directory. Weights are checked by the loader."""
    if config.model is None:
        raise ValueError("the cuda backend needs EngineConfig.model: an HF model directory")
    directory = Path(config.model)
    if not directory.is_dir():
        raise FileNotFoundError(f"model: {config.model!r} is not a directory")
    required = ["config.json"]
    if load_format == "safetensors" and config.tokenizer is None:
        required.append("tokenizer.json")
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"model: {directory} has no {', '.join(missing)}")
    return directory


class CudaBackend(Backend):
    """Runs an HF Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 or MoE (Qwen3-MoE, Qwen2-MoE,
    Mixtral, gpt-oss) checkpoint, in its dtype or FP8, with torch, Triton paged
    attention and on-device sampling; see ``engine_core_cuda`` for the ``backend_options``. It
    supports async scheduling: sampled tokens stay on the device as the next step's input
    ids."""

    supports_async_scheduling = True

    def __init__(
        self, config: EngineConfig, *, tp_rank: int = 0, tp_directory: str | None = None
    ) -> None:
        """``tp_rank``/``tp_directory``: set by a tensor-parallel worker for its own rank."""
        super().__init__(config)
        self.options = rank_options(parse_options(config), tp_rank)
        model_dir = _check_model_dir(config, self.options.load_format)
        self.model_config = load_model_config(model_dir, config.quantization)
        self.tp_rank = tp_rank
        size = config.tensor_parallel_size
        # A field that does not divide fails here, before any process starts.
        shard_model_config(self.model_config, size)
        self.tp: Coordinator | None = None
        parallel: TensorParallel | None = None
        if size > 1 and tp_rank == 0:
            self.tp = Coordinator(config, self.options)
            parallel = self.tp.parallel
        elif size > 1:
            assert tp_directory is not None
            share_cpu(torch.device(self.options.device), size, self.options.cpu_threads)
            parallel = join(self.options, tp_rank, size, tp_directory)
        started = time.perf_counter()
        try:
            self.runner = ModelRunner(config, self.options, self.model_config, parallel)
            if self.tp is not None:
                self.tp.loaded()
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise
        logger.info(
            "loaded %s (%s) on %s in %.1f s", model_dir, self.model_config.architecture,
            self.runner.device, time.perf_counter() - started,
        )  # fmt: skip
        self._profiler: Any = None
        self.is_sleeping = False
        self._sleep_level = 0
        self._param_shapes: list[torch.Size] = []
        self._closed = False
        self._lora_lock = threading.Lock()
        self._lora_calls: list[tuple[Any, ...]] = []
        """Tensor parallelism: adapter calls for the workers, sent before the next step."""
        self.kv_worker: KVConnectorWorker | None = None
        """The KV connector's worker half on this rank (``init_kv_connector``)."""
        self._kv_idle = False

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    # -- startup --------------------------------------------------------------------------------

    def resolved_settings(self) -> dict[str, str | int | float | bool]:
        """Device, dtype, kernels, and on the CPU torch's thread count with where it came from
        (``cpu_threads``, ``OMP_NUM_THREADS`` or the default, the usable cores less one)."""
        runner = self.runner
        settings: dict[str, str | int | float | bool] = {
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kernels": self.options.kernels,
        }
        if runner.cpu_threads is not None:
            settings["cpu_threads"] = runner.cpu_threads.describe()
        return settings

    def kv_cache_spec(self) -> KVCacheSpec | list[LayerSpec]:
        """One spec per layer (its kind, window or chunk) for a model with window or chunked
        layers, so the core gives them KV-cache groups of their own and releases what their
        windows left behind (``docs/cuda_kv_groups.md``); one ``KVCacheSpec`` for a model of
        full-attention layers, and with a draft model, which reads and writes through one
        table of every position."""
        c = self.runner.model_config  # this rank's shard: the core sizes blocks per rank
        geometry = {
            "num_kv_heads": c.num_kv_heads,
            "head_size": c.head_size,
            "dtype_bytes": self.runner.kv_dtype.itemsize,
        }
        kinds = [c.layer_attention(i) for i in range(c.num_layers)]
        if self.runner.drafter is not None or all(k.kind == "full_attention" for k in kinds):
            return KVCacheSpec(num_layers=c.num_layers, **geometry)
        specs: list[LayerSpec] = []
        for k in kinds:
            if k.kind == "sliding_attention" and k.window is not None:
                specs.append(SlidingWindowSpec(window=k.window, **geometry))
            elif k.kind == "chunked_attention" and k.chunk is not None:
                specs.append(ChunkedLocalSpec(chunk=k.chunk, **geometry))
            else:
                specs.append(FullAttentionSpec(**geometry))
        return specs

    def available_kv_cache_memory(self) -> int:
        """The minimum over the ranks under tensor parallelism. With a draft model (on rank 0
        alone), that rank's share of the target's cache: the draft's blocks take the rest (same
        block ids)."""
        others: list[Any] = []
        if self.tp is None:
            own = available_kv_cache_memory(self.runner, self.config.kv_cache_memory_fraction)
        else:
            with self.tp.on_every_rank("available_kv_cache_memory") as others:
                own = available_kv_cache_memory(self.runner, self.config.kv_cache_memory_fraction)
        drafter = self.runner.drafter
        if drafter is not None:
            block_size = self.config.block_size
            spec = self.kv_cache_spec()  # one group with a draft model
            assert isinstance(spec, KVCacheSpec)
            block = spec.bytes_per_block(block_size)
            own = own * block // (block + drafter.block_bytes(block_size))
        return min([own, *(v for v in others if isinstance(v, int))])

    def initialize_kv_cache(
        self, num_blocks: int, kv_groups: Sequence[Sequence[int]] | None = None
    ) -> None:
        """``kv_groups``: the layer indices of each KV-cache group, in the order of the block
        tables the scheduler sends (default: one group of every layer); see
        :mod:`engine_core_cuda._kv_layout`."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be an int > 0, got {num_blocks!r}")
        layout = None
        if kv_groups is not None:
            layout = KVLayout.of(kv_groups, self.model_config.num_layers)
        if self.tp is not None:
            groups = None if layout is None else json.dumps(layout.groups)
            with self.tp.on_every_rank("initialize_kv_cache", num_blocks, groups):
                self._initialize_kv_cache(num_blocks, layout)
        else:
            self._initialize_kv_cache(num_blocks, layout)

    def _initialize_kv_cache(self, num_blocks: int, layout: KVLayout | None) -> None:
        self.runner.drop_graphs()  # they would point at the old cache
        release = getattr(self.kv_worker, "release_kv_caches", None)
        if release is not None:
            release()
        self.runner.allocate_kv_cache(num_blocks, layout)
        if self.kv_worker is not None:
            self.kv_worker.register_kv_caches(self.runner.kv_tensor)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        runner = self.runner
        options = self.options
        if not (options.cuda_graphs and runner.device.type == "cuda"):
            return
        if not runner.ops.graph_capturable:
            logger.warning("CUDA graphs need kernels='triton'; running without them")
            return
        parallel = runner.parallel
        if parallel is not None and parallel.backend != "nccl":
            logger.warning("CUDA graphs need NCCL collectives under tensor parallelism")
            return
        started = time.perf_counter()
        max_batch = graph_max_batch_size(runner)
        spec = self.config.speculative_config
        # One query length per allowed draft count, so every step the policy picks has a graph.
        query_lens = [1 + k for k in spec.k_choices] if spec is not None else []
        graphs = DecodeGraphs(runner, graph_batch_sizes(max_batch), query_lens)
        with torch.inference_mode():
            graphs.capture()
        runner.graphs = graphs
        if runner.drafter is not None:
            draft_graphs = DecodeGraphs(
                runner, graph_batch_sizes(max_batch), query_lens, drafter=runner.drafter
            )
            with torch.inference_mode():
                draft_graphs.capture()
            runner.drafter.graphs = draft_graphs
        logger.info("CUDA graphs captured in %.1f s", time.perf_counter() - started)

    def spec_support(self) -> SpecSupport | None:
        """Verification of drafts, exact (seeded sampling gives the tokens it gives without
        speculation); under tensor parallelism rank 0 verifies and broadcasts the outcome, and
        a draft model runs whole on rank 0 alone."""
        if self.runner.drafter is None:
            return SpecSupport(exact_verification=True)
        # The draft model writes one KV slot past the verified window per draft it proposes.
        return SpecSupport(
            proposers=["draft_model"], exact_verification=True, lookahead_per_draft=1
        )

    def lora_support(self) -> LoRASupport | None:
        """PEFT LoRA adapters up to ``max_lora_rank`` on the attention projections, and on
        the MLP's of a dense model (``docs/cuda_lora.md``); on FP8 weights too (the adapters
        stay in the model dtype)."""
        return LoRASupport(
            max_rank=self.config.max_lora_rank, target_modules=served_modules(self.model_config)
        )

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter into host memory (safe while a step runs: the slots are
        written only by the step thread, when a step needs the adapter)."""
        runner_lora = self.runner.lora
        if runner_lora is None:
            raise LoRAError(lora.lora_name, "LoRA is off (EngineConfig.enable_lora)")
        runner_lora.add(lora.lora_int_id, lora.lora_name, lora.lora_path)
        if self.tp is not None:  # the workers read their parts before the next step
            with self._lora_lock:
                self._lora_calls.append(("add_lora", lora.lora_int_id, lora.lora_name,
                                         lora.lora_path))  # fmt: skip

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter; requests still using it keep it, and its slot, until they
        finish."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_int_id)
            if self.tp is not None:
                with self._lora_lock:
                    self._lora_calls.append(("remove_lora", lora_int_id))

    def _send_lora_calls(self) -> None:
        """Tensor parallelism: the adapter calls made since the last step, on every worker,
        from the step thread between steps (the worker channel is the step thread's). Rank 0
        checked each adapter already; a worker that cannot read its part fails the step."""
        assert self.tp is not None
        with self._lora_lock:
            calls, self._lora_calls = self._lora_calls, []
        for method, *args in calls:
            with self.tp.on_every_rank(method, *args):
                pass

    def init_kv_connector(self, name: str, layout: KVConnectorLayout) -> None:
        """The ``"host"`` tier's worker half is :mod:`engine_core_cuda._kv_offload` (a pinned
        host buffer, copies on their own streams); another connector brings its own
        (``KVConnectorProvider.worker``). Set up on every tensor-parallel rank."""
        import msgspec

        if self.runner.kv_tensor is None:
            raise RuntimeError("init_kv_connector called before initialize_kv_cache()")
        if name == "pd":
            self._init_pd(layout)
            return
        if self.tp is not None:
            encoded = msgspec.json.encode(layout).decode()
            with self.tp.on_every_rank("init_kv_connector", name, encoded):
                self._init_kv_connector(name, layout)
        else:
            self._init_kv_connector(name, layout)

    def _init_kv_connector(self, name: str, layout: KVConnectorLayout) -> None:
        from engine_core_cuda._kv_offload import build_worker

        runner = self.runner
        worker = build_worker(self.config, layout, name, runner.device, self.tp_rank,
                              runner.parallel)  # fmt: skip
        worker.register_kv_caches(runner.kv_tensor)
        self.kv_worker = worker

    def _init_pd(self, layout: KVConnectorLayout) -> None:
        """The ``"pd"`` connector (prefill/decode disaggregation): :mod:`._pd_transfer` on
        every rank, each serving its shard; rank 0 learns the ranks' transfer addresses."""
        from engine_core_cuda._pd_transfer import CudaPDWorker, layout_text

        if self.tp is None:
            self.init_pd_rank(layout)
            return
        segment = CudaPDWorker.segment_of(self.config)
        with self.tp.on_every_rank("init_pd", layout_text(layout), segment) as others:
            own = self.init_pd_rank(layout)
        own.set_addresses([own.address, *(str(a) for a in others)])

    def init_pd_rank(self, layout: KVConnectorLayout, segment: str | None = None) -> Any:
        """This rank's ``"pd"`` worker half (``segment``: rank 0's handoff segment)."""
        from engine_core_cuda._pd_transfer import CudaPDWorker

        runner = self.runner
        worker = CudaPDWorker(self.config, layout, tp_rank=self.tp_rank, segment=segment,
                              parallel=runner.parallel)  # fmt: skip
        worker.register_kv_caches(runner.kv_tensor)
        self.kv_worker = worker
        return worker

    def kv_connector_report(self) -> KVConnectorReport | None:
        """The worker half's report of this step (on every rank: the ranks agree on it). A
        step that schedules no tokens waits a little (at most 5 ms) for a transfer to end."""
        worker = self.kv_worker
        if worker is None:
            return None
        if self._kv_idle and hasattr(worker, "wait"):
            worker.wait(0.005)
        return worker.get_finished()

    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def max_model_len(self) -> int | None:
        return self.model_config.max_model_len

    # -- stepping -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._closed:
            raise RuntimeError("execute_model called after close()")
        if self.is_sleeping:
            raise RuntimeError("execute_model called while the backend sleeps (call wake_up())")
        if self.tp is None:
            with torch.inference_mode():
                self._execute(scheduler_output)
            return
        if self._lora_calls:
            self._send_lora_calls()
        self.tp.step(scheduler_output)
        try:
            with torch.inference_mode():
                self._execute(scheduler_output)
        except Exception as exc:
            self.tp.blame(exc)
            raise

    def _execute(self, scheduler_output: SchedulerOutput) -> None:
        worker = self.kv_worker
        if worker is None:
            self.runner.execute_model(scheduler_output)
            return
        self._kv_idle = scheduler_output.total_num_scheduled_tokens == 0
        worker.start_step(scheduler_output.kv_connector_metadata)
        self.runner.execute_model(scheduler_output)
        worker.after_forward()

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        """Under tensor parallelism the sampled ids are broadcast to the workers here."""
        try:
            with torch.inference_mode():
                output = self.runner.sample_tokens(grammar_bitmask)
                report = self.kv_connector_report()
        except Exception as exc:
            if self.tp is not None:
                self.tp.blame(exc)
            raise
        if self.tp is not None:
            self.tp.sampled()
        if report is not None:
            output.kv_connector_report = report
        return output

    def sample_tokens_async(self, grammar_bitmask: Any | None) -> AsyncModelRunnerOutput:
        try:
            with torch.inference_mode():
                handle = self.runner.sample_tokens_async(grammar_bitmask)
                report = self.kv_connector_report()
        except Exception as exc:
            if self.tp is not None:
                self.tp.blame(exc)
            raise
        result: AsyncModelRunnerOutput = handle
        if self.tp is not None:
            self.tp.sampled()
            result = self.tp.watch(handle)
        if report is None:
            return result
        from engine_core_cuda._kv_offload import WithReport

        return WithReport(result, report)

    # -- control --------------------------------------------------------------------------------

    def profile(self, action: Literal["start", "stop"]) -> None:
        """Start or stop the torch profiler; ``stop`` writes a Chrome trace into
        ``backend_options["profile_dir"]``."""
        if self.tp is not None and action in ("start", "stop"):
            with self.tp.on_every_rank("profile", action):
                self._profile(action)
        else:
            self._profile(action)

    def _profile(self, action: str) -> None:
        if action == "start":
            if self._profiler is not None:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        elif action == "stop":
            profiler, self._profiler = self._profiler, None
            if profiler is None:
                return
            profiler.stop()
            directory = Path(self.options.profile_dir)
            directory.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = directory / f"trace-{stamp}-rank{self.tp_rank}-{id(profiler):x}.json"
            profiler.export_chrome_trace(str(path))
            logger.info("profiler trace written to %s", path)
        else:
            raise ValueError(f"action must be 'start' or 'stop', got {action!r}")

    def sleep(self, level: int = 1) -> None:
        """Free the device: the KV cache is discarded (cached prefixes must not be reused
        afterwards) and the weights are moved to host memory (level 1) or dropped (level 2, they
        are reloaded from disk by :meth:`wake_up`)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            return
        if self.tp is not None:
            self.tp.workers.call("sleep", level)
        runner = self.runner
        runner.drop_graphs()
        runner.drop_requests()
        release = getattr(self.kv_worker, "release_kv_caches", None)
        if release is not None:
            release()  # its copies end before the cache is freed
        runner.release_kv_cache()
        if runner.lora is not None:
            runner.lora.release()
        self._param_shapes = [p.shape for p in runner.parameters()]
        if level == 2:
            from engine_core_cuda._layers import unpack_cpu_linears

            unpack_cpu_linears(runner.modules())
        with torch.no_grad():
            for param in runner.parameters():
                param.data = (
                    param.data.to("cpu")
                    if level == 1
                    else torch.empty(0, dtype=param.dtype, device=param.device)
                )
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.is_sleeping = True
        self._sleep_level = level

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: weights back, an empty KV cache of the same size, graphs
        recaptured."""
        if not self.is_sleeping:
            return
        if self.tp is not None:
            with self.tp.on_every_rank("wake_up"):
                self._wake_up()
        else:
            self._wake_up()

    def _wake_up(self) -> None:
        runner = self.runner
        with torch.no_grad():
            for param, shape in zip(runner.parameters(), self._param_shapes, strict=True):
                if self._sleep_level == 1:
                    param.data = param.data.to(runner.device)
                else:
                    param.data = torch.empty(shape, dtype=param.dtype, device=runner.device)
        if self._sleep_level == 2:
            runner.load_weights()
        if runner.lora is not None:
            runner.lora.restore()
        if runner.num_blocks:
            runner.allocate_kv_cache(runner.num_blocks)
            if self.kv_worker is not None:
                self.kv_worker.register_kv_caches(runner.kv_tensor)
            self._capture_graphs()
        self.is_sleeping = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.kv_worker is not None:
            self.kv_worker.close()
            self.kv_worker = None
        if self.tp is not None:
            self.tp.close()
        elif self.runner.parallel is not None:
            self.runner.parallel.destroy()
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        runner = self.runner
        runner.drop_graphs()
        runner.drop_requests()
        runner.release_kv_cache()
        from engine_core_cuda._layers import unpack_cpu_linears

        unpack_cpu_linears(runner.modules())
        with torch.no_grad():
            for param in runner.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
