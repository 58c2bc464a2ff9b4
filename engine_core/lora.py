"""Multi-LoRA serving: the public types (no torch).

A request names a LoRA adapter with a :class:`LoRARequest` (as vLLM does: ``lora_name``,
``lora_int_id``, ``lora_path``, positional in that order); a backend says what it can serve
with :class:`LoRASupport` (:meth:`engine_core.abc.Backend.lora_support`); an adapter that
cannot be served raises :class:`LoRAError` (:class:`UnknownLoRAError` for a name nobody
registered). ``docs/lora.md`` describes the contract for backend authors.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from engine_core.errors import InvalidRequestError

__all__ = [
    "LORA_TARGET_MODULES",
    "LoRAError",
    "LoRARequest",
    "LoRASupport",
    "PeftAdapterConfig",
    "UnknownLoRAError",
    "check_adapter",
    "read_adapter_config",
]

LORA_TARGET_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
"""The module names PEFT writes for a Llama-style decoder's linears."""


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter a request runs with.

    ``lora_int_id`` (>= 1) is the adapter's identity inside the engine: two requests with the
    same id run the same adapter (0 means the base model and is never a valid id here).
    ``lora_path`` is a PEFT adapter directory (``adapter_config.json`` and the weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or not 1 <= self.lora_int_id < 1 << 63
        ):
            raise ValueError(
                f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty str, got {self.lora_path!r}")

    def key_bytes(self) -> bytes:
        """The adapter's part of every prefix-cache key: its id, name and path, so no block is
        shared across adapters or with the base model. Built once per adapter (every request
        of it asks; over the wire each brings its own equal copy)."""
        key = _KEY_BYTES.get(self)
        if key is None:
            if len(_KEY_BYTES) >= _MAX_KEYS_KEPT:
                _KEY_BYTES.clear()
            key = _KEY_BYTES[self] = (
                b"\x00lora\x00"
                + str(self.lora_int_id).encode()
                + b"\x00"
                + self.lora_name.encode()
                + b"\x00"
                + self.lora_path.encode()
            )
        return key


_KEY_BYTES: dict[LoRARequest, bytes] = {}
"""``LoRARequest.key_bytes`` of the adapters seen (cleared past ``_MAX_KEYS_KEPT``)."""
_MAX_KEYS_KEPT = 4096


class LoRASupport(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can serve of LoRA (:meth:`engine_core.abc.Backend.lora_support`)."""

    max_rank: int
    """The largest adapter rank (``r`` in ``adapter_config.json``) it serves."""
    target_modules: frozenset[str]
    """The modules an adapter may target, named as PEFT writes them (``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``)."""


class LoRAError(InvalidRequestError):
    """An adapter cannot be served: its path does not exist, its ``adapter_config.json`` is
    missing or for another base model, its rank or target modules are beyond the engine's or
    the backend's limits, or LoRA is off. The HTTP server answers 400. ``lora_name`` names the
    adapter, ``reason`` says why."""

    def __init__(self, lora_name: str, reason: str, request_id: str | None = None) -> None:
        super().__init__(f"LoRA adapter {lora_name!r}: {reason}", request_id)
        self.lora_name = lora_name
        self.reason = reason


class UnknownLoRAError(LoRAError):
    """No adapter of that name is registered (the HTTP server answers 404
    ``model_not_found``)."""


class PeftAdapterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a PEFT ``adapter_config.json`` the engine checks."""

    rank: int
    target_modules: frozenset[str]
    base_model_name_or_path: str | None = None
    lora_alpha: float | None = None


def read_adapter_config(lora: LoRARequest) -> PeftAdapterConfig:
    """Read and check ``adapter_config.json`` of ``lora.lora_path``; :class:`LoRAError` naming
    the adapter when the directory or the file is missing, or the file is not a LoRA config."""
    name = lora.lora_name
    if not os.path.isdir(lora.lora_path):
        raise LoRAError(name, f"adapter path {lora.lora_path!r} does not exist")
    path = os.path.join(lora.lora_path, "adapter_config.json")
    try:
        with open(path, "rb") as f:
            raw: Any = json.loads(f.read())
    except FileNotFoundError:
        raise LoRAError(name, f"no adapter_config.json in {lora.lora_path!r}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(name, f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise LoRAError(name, f"{path} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise LoRAError(name, f"peft_type is {peft_type!r}, not 'LORA'")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(name, f"adapter_config.json: r must be an int >= 1, got {rank!r}")
    modules = raw.get("target_modules")
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise LoRAError(
            name, f"adapter_config.json: target_modules must be a list of names, got {modules!r}"
        )
    base = raw.get("base_model_name_or_path")
    alpha = raw.get("lora_alpha")
    return PeftAdapterConfig(
        rank=rank,
        # "model.layers.0.self_attn.q_proj" targets q_proj
        target_modules=frozenset(m.rsplit(".", 1)[-1] for m in modules),
        base_model_name_or_path=base if isinstance(base, str) else None,
        lora_alpha=float(alpha) if isinstance(alpha, int | float) else None,
    )


def check_adapter(
    lora: LoRARequest, config: PeftAdapterConfig, support: LoRASupport, max_lora_rank: int
) -> None:
    """:class:`LoRAError` unless the engine (``max_lora_rank``) and the backend (``support``)
    can serve an adapter of ``config``."""
    name = lora.lora_name
    if config.rank > max_lora_rank:
        raise LoRAError(name, f"rank {config.rank} is above max_lora_rank ({max_lora_rank})")
    if config.rank > support.max_rank:
        raise LoRAError(
            name, f"rank {config.rank} is above the backend's largest ({support.max_rank})"
        )
    unsupported = config.target_modules - support.target_modules
    if unsupported:
        raise LoRAError(
            name,
            f"target modules {sorted(unsupported)} are not served by the backend "
            f"(it serves {sorted(support.target_modules)})",
        )
