"""``LLM``: offline batch generation, the engine core stepped in the caller's thread."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec

from engine_core._core.engine_io import EngineInfo, EngineStats
from engine_core._core.tokenizer import (
    PromptInput,
    Tokenizer,
    load_served_tokenizer,
    parse_prompt,
)
from engine_core._engine.client import EngineCoreClient, make_client
from engine_core._engine.inproc_client import InprocClient
from engine_core._frontend.output_processor import OutputProcessor
from engine_core._frontend.request_checks import (
    check_lora_id,
    check_lora_request,
    check_params_list,
)
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError, EngineError
from engine_core.lora import LoRARequest
from engine_core.outputs import RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM"]


class LLM:
    """Generate completions for batches of prompts.

    ``LLM(**fields)`` takes :class:`~engine_core.EngineConfig` fields as keyword arguments (an
    unknown one raises ``TypeError`` naming it); :meth:`from_config` takes a config. Use it as
    a context manager, or call :meth:`close`.
    """

    def __init__(self, **config_fields: Any) -> None:
        self._start(EngineConfig.from_kwargs(**config_fields))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` running ``config``."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.tokenizer: Tokenizer = load_served_tokenizer(config.model, config.tokenizer)
        self._client: EngineCoreClient = make_client(config, multiprocess=False)
        if isinstance(self._client, InprocClient):
            self.config = self._client.engine_core.config
        else:
            info = self._client.info
            self.config = msgspec.structs.replace(config, max_model_len=info.max_model_len)
        """The config with ``max_model_len`` (and, in process, ``max_num_batched_tokens``)
        resolved."""
        self._processor = OutputProcessor(
            self.tokenizer, max_model_len=self._client.info.max_model_len
        )
        self._ids = itertools.count()
        self._closed = False

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion and return the outputs in input order.

        A prompt is a string, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``;
        ``sampling_params`` is one for all prompts or a list with one per prompt (default:
        ``SamplingParams()``). A prompt the engine cannot serve (too long, token ids outside the
        vocabulary) gets an output with finish_reason ``"error"`` and ``error`` set; the others
        complete normally. ``lora_request`` runs every prompt with that LoRA adapter, or is a
        list with one adapter (or None: the base model) per prompt.
        """
        if self._closed:
            raise EngineClosedError("the LLM was closed")
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        check_params_list(self.config, params_list)  # before any work is done
        loras = _as_lora_list(lora_request, len(prompt_list))
        for lora in loras:
            check_lora_request(self.config, lora)
        parsed = [parse_prompt(p, self.tokenizer) for p in prompt_list]
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        # Only final outputs are wanted here, the cheapest output kind.
        final_params: dict[int, SamplingParams] = {}
        try:
            for position, ((text, token_ids), params) in enumerate(
                zip(parsed, params_list, strict=True)
            ):
                final = final_params.get(id(params))
                if final is None:
                    final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                    final_params[id(params)] = final
                request_id = str(next(self._ids))
                order[request_id] = position
                for request in self._processor.add_request(request_id, text, token_ids, final):
                    request.lora_request = loras[position]
                    self._client.add_request(request)
            self._run(order, results, _progress_bar(len(prompt_list), use_tqdm))
        except BaseException:
            self._abort(order)
            raise
        return [r for r in results if r is not None]

    def _run(
        self, order: dict[str, int], results: list[RequestOutput | None], progress: Any
    ) -> None:
        client, processor = self._client, self._processor
        remaining = len(order)
        try:
            while remaining:
                outputs = client.get_output()
                processed = processor.process_outputs(outputs)
                if processed.reqs_to_abort:
                    client.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    position = order.get(output.request_id)
                    if position is not None and output.finished:
                        results[position] = output
                        remaining -= 1
                        if progress is not None:
                            progress.update(1)
                if outputs.is_empty and not _has_work(client):
                    raise RuntimeError(
                        f"the engine has no work left but {remaining} request(s) did not finish"
                    )
        finally:
            if progress is not None:
                progress.close()

    def _abort(self, order: dict[str, int]) -> None:
        """Forget this call's requests after an error, so the engine stays usable."""
        engine_ids: list[str] = []
        for request_id in order:
            engine_ids.extend(self._processor.abort_request(request_id))
        if engine_ids and not self._closed:
            # The error being raised matters more than a failure to clean up after it.
            with contextlib.suppress(EngineError):
                self._client.abort_requests(engine_ids)

    @property
    def info(self) -> EngineInfo:
        """What the engine core reported at startup (blocks, block size, max_model_len...)."""
        return self._client.info

    @property
    def vocab_size(self) -> int:
        return self._client.info.vocab_size

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded and outputs decoded with."""
        return self.tokenizer

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters."""
        stats: EngineStats = self._client.call_utility("get_stats")
        return stats

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter and keep it; True once loaded. Raises
        :class:`~engine_core.lora.LoRAError` naming it when it cannot be served."""
        check_lora_request(self.config, lora_request, required=True)
        done: bool = self._client.call_utility("add_lora", lora_request)
        return done

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False: it was not loaded)."""
        done: bool = self._client.call_utility("remove_lora", check_lora_id(lora_int_id))
        return done

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        ids: list[int] = self._client.call_utility("list_loras")
        return set(ids)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter loaded until it is removed (never evicted)."""
        done: bool = self._client.call_utility("pin_lora", check_lora_id(lora_int_id))
        return done

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False when requests still hold blocks."""
        done: bool = self._client.call_utility("reset_prefix_cache")
        return done

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        if not self._closed:
            self._closed = True
            self._client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _has_work(client: EngineCoreClient) -> bool:
    """Whether an in-process engine still has something to do (an engine process only sends
    non-empty outputs, so this question does not arise there)."""
    return not isinstance(client, InprocClient) or client.has_unfinished_requests()


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, str | bytes):
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(
                f"lora_request has {len(loras)} entries for {num_prompts} prompts: give one "
                "LoRARequest for all, or one (or None) per prompt"
            )
        return loras
    raise TypeError(
        "lora_request must be a LoRARequest, a list of them (or None) per prompt, or None; "
        f"got {type(lora_request).__name__}"
    )


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(
        f"prompts must be a str, a prompt dict or a list of them, got {type(prompts).__name__}"
    )


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(params_list)} entries but there are {num_prompts} prompts"
        )
    for p in params_list:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params entries must be SamplingParams, got {type(p)}")
    return params_list


def _progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm progress bar, or None when disabled or tqdm is not installed."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
