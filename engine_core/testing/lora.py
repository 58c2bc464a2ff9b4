"""The LoRA conformance check (:func:`check_lora`), exported by :mod:`engine_core.testing`: a
backend that declares LoRA support (``Backend.lora_support``) runs it with two or more of its
own adapters (``docs/lora.md``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import msgspec

from engine_core.config import EngineConfig
from engine_core.lora import LoRAError, LoRARequest, LoRASupport
from engine_core.testing.harness import (
    BackendFactory,
    assert_same,
    default_config,
    make_prompt,
    opened,
)

__all__ = ["check_lora"]

_MAX_TOKENS = 8


def check_lora(
    make_backend: BackendFactory,
    adapters: Sequence[LoRARequest],
    config: EngineConfig | None = None,
) -> None:
    """A backend serves LoRA adapters as ``docs/lora.md`` says, with ``adapters`` (two or more,
    distinct ids, each giving greedy output that differs from the base model's on a short
    prompt):

    1. ``lora_support()`` is a :class:`LoRASupport` with a rank and target modules;
    2. ``add_lora`` loads each adapter; each changes the greedy output of the base model;
    3. one batch of the base model and every adapter (a prefill beside decodes) gives each
       request the tokens it gets alone;
    4. removing one adapter leaves the others' results as they were; adding it again gives
       its results back;
    5. a bad adapter (no such directory, an ``adapter_config.json`` that is not JSON) raises
       :class:`LoRAError` naming it, and the loaded adapters keep working.
    """
    assert len(adapters) >= 2, "check_lora needs two or more adapters"
    assert len({a.lora_int_id for a in adapters}) == len(adapters), "adapters need distinct ids"
    config = msgspec.structs.replace(
        config or default_config(), enable_lora=True, max_loras=len(adapters)
    )
    with opened(make_backend, config) as h:
        backend = h.backend
        support = backend.lora_support()
        assert isinstance(support, LoRASupport), (
            f"lora_support() returned {support!r}, not a LoRASupport"
        )
        assert support.max_rank >= 1, f"LoRASupport.max_rank is {support.max_rank}"
        assert support.target_modules, "LoRASupport.target_modules is empty"
        ready: set[int] = set()
        h.scheduler.lora_ready = ready
        for adapter in adapters:
            backend.add_lora(adapter)
            ready.add(adapter.lora_int_id)

        prompt = make_prompt(5, 2 * h.block_size + 3)
        base = h.generate("base-alone", prompt, _MAX_TOKENS)
        alone = {}
        for adapter in adapters:
            got = h.generate(f"{adapter.lora_name}-alone", prompt, _MAX_TOKENS, adapter)
            assert got != base, (
                f"adapter {adapter.lora_name!r} gave the base model's tokens {got}: the "
                "adapter is not applied"
            )
            alone[adapter.lora_int_id] = got

        # 3. One mixed batch: the base model decodes while the adapters' prompts prefill.
        h.add("base-mixed", prompt, _MAX_TOKENS)
        h.step()
        for adapter in adapters:
            h.add(f"{adapter.lora_name}-mixed", prompt, _MAX_TOKENS, lora_request=adapter)
        scheduler_output, _ = h.step()
        assert set(scheduler_output.lora_ids) == set(alone), (
            f"the scheduler sent lora_ids {scheduler_output.lora_ids}"
        )
        outputs = h.run()
        assert_same("the base model in a mixed LoRA batch", outputs["base-mixed"], base)
        for adapter in adapters:
            assert_same(
                f"adapter {adapter.lora_name!r} in a mixed batch",
                outputs[f"{adapter.lora_name}-mixed"],
                alone[adapter.lora_int_id],
            )

        # 4. Remove one: the others are unchanged; adding it again restores it.
        first, rest = adapters[0], adapters[1:]
        backend.remove_lora(first.lora_int_id)
        ready.discard(first.lora_int_id)
        for adapter in rest:
            assert_same(
                f"adapter {adapter.lora_name!r} after {first.lora_name!r} was removed",
                h.generate(f"{adapter.lora_name}-after-remove", prompt, _MAX_TOKENS, adapter),
                alone[adapter.lora_int_id],
            )
        backend.add_lora(first)
        ready.add(first.lora_int_id)
        assert_same(
            f"adapter {first.lora_name!r} added again",
            h.generate(f"{first.lora_name}-again", prompt, _MAX_TOKENS, first),
            alone[first.lora_int_id],
        )

        # 5. Bad adapters are refused, naming them.
        with tempfile.TemporaryDirectory() as tmp:
            broken = os.path.join(tmp, "broken")
            os.mkdir(broken)
            with open(os.path.join(broken, "adapter_config.json"), "w") as f:
                f.write("{not json")
            free_id = max(a.lora_int_id for a in adapters) + 1
            for bad in (
                LoRARequest("missing-adapter", free_id, os.path.join(tmp, "missing")),
                LoRARequest("broken-adapter", free_id + 1, broken),
            ):
                try:
                    backend.add_lora(bad)
                except LoRAError as e:
                    assert e.lora_name == bad.lora_name, (
                        f"add_lora({bad.lora_name!r}) raised a LoRAError naming {e.lora_name!r}"
                    )
                else:
                    raise AssertionError(
                        f"add_lora accepted {bad.lora_name!r} ({bad.lora_path}), which is no "
                        "adapter"
                    )
        last = adapters[-1]
        assert_same(
            f"adapter {last.lora_name!r} after a refused adapter",
            h.generate(f"{last.lora_name}-after-refusal", prompt, _MAX_TOKENS, last),
            alone[last.lora_int_id],
        )
