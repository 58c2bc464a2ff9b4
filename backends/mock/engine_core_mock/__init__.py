"""engine-core-mock: a deterministic CPU backend for engine-core.

For CI, scheduler benchmarks, fault-injection tests and capacity planning. Use it with
``EngineConfig(backend="mock")``; the entry point ``mock`` in the group ``engine_core.backends``
names :data:`engine_core_mock._provider.provider`, which imports nothing heavy.

Tokens (``vocab_size`` V):

- greedy (``temperature`` < 1e-5): the next token is ``(previous token + 1) % V``, counting up
  from the last token of the sequence (with the byte tokenizer ``"abc"`` continues ``"defg"``);
- otherwise: ``xxh3_64(seed, token history) % V``, where the seed is ``SamplingParams.seed`` or
  is derived from ``EngineConfig.seed`` and the request id; identical across runs, processes and
  batch compositions. ``top_p``, ``top_k``, ``min_p`` and penalties are ignored;
- under a grammar the mock ends what it writes, as a model would: greedy decoding takes EOS as
  soon as the grammar allows it, else a closing ``"``, ``]`` or ``}`` the grammar allows (never
  right after its opener: a string gets one character, an array one element unless the schema
  asks for more, an object one member; inside a string only the quote closes), else the first
  allowed token at or after the rule's token (wrapping around) that is not whitespace, when
  the grammar allows any such token. Random sampling draws among the allowed tokens (from the
  same stable hash) with those closing tokens 64 times heavier than the others and whitespace
  64 times lighter. So a ``tool_choice="required"`` call or a JSON schema completes in a few
  dozen tokens at any temperature, instead of appending elements or whitespace until
  ``max_tokens``;
- while a request has fewer than ``min_tokens`` outputs its EOS and ``stop_token_ids`` are
  masked: the mock then takes the first token at or after its choice that is not masked;
- ``logit_bias``: a bias of -100 bans its token, one of +100 forces it (the first forced token
  at or after the rule's token, among those allowed); with greedy decoding the other values
  choose the token of highest synthetic logit (below) plus bias; random sampling ignores them;
- logprobs come from a synthetic distribution centred on the greedy token ``g``:
  rank ``((t - g) % V) + 1`` and logprob ``-rank * ln 2``.

``backend_options`` (unknown names raise ``ValueError``):

- ``vocab_size``, ``num_layers``, ``num_kv_heads``, ``head_size``, ``dtype_bytes``,
  ``device_memory_bytes``, ``weight_bytes``, ``max_model_len``: override the geometry, which is
  otherwise read from ``config.json`` of ``EngineConfig.model`` or synthetic (32 layers, 8 KV
  heads of 128, 2-byte dtype, 16 GiB of device memory, no weights). The vocabulary defaults to
  the model's, else the served tokenizer's (its added tokens included; 258 for the byte
  tokenizer), so every token the mock samples decodes to text. ``EngineConfig.kv_cache_dtype``
  ``"fp8"`` makes the KV element one byte (about twice the blocks);
- ``latency``: ``{"step_s", "per_token_s", "per_context_token_s"}``, each step then lasts
  ``step_s + per_token_s * scheduled tokens + per_context_token_s * context tokens``;
- ``load_s``: seconds that constructing the backend takes (a model load);
- ``fault``: ``{"kind": "raise" | "exit" | "hang" | "freeze", "at_step": N}``, in the N-th step
  (``execute_model`` call), when its results are waited for: raise ``RuntimeError``, exit the
  process with status 13, block forever, or block forever holding the GIL (the whole process
  stops answering); with ``"rank": R`` only the engine of ``data_parallel_rank`` R fails (data
  parallelism);
- ``replies``: ``[{"match": "<regex>", "text": "..."}, ...]``, the mock plays a model: a prompt
  whose text (decoded with the served tokenizer) matches an entry's regex is answered with that
  entry's text, tokenized with the served tokenizer and followed by EOS (``"eos": false`` leaves
  it out); after the reply the usual rule goes on, and masks and grammars move a reply's tokens
  as they move the rule's. So a tool-calling or reasoning flow runs end to end in CI;
- ``tensor_parallel_size``: pretend N ranks: N-1 dummy worker processes receive each step's
  broadcast and model it (no torch), the KV spec reports per-rank heads; with
  ``tensor_parallel_memory_bytes`` (one int per rank) KV sizing takes the minimum over ranks;
- ``copy_prompt``: ``{"fraction": f, "period": P}``, outputs come in periods of ``P`` tokens whose
  last ``round(f * P)`` copy a span of the prompt (a stable hash of the period chooses where), as
  a summary or an edit repeats its input: the workload prompt-lookup speculation is made for;
- ``spec``: speculative decoding (``EngineConfig.speculative_config``). The mock always verifies
  drafts exactly: it samples each drafted position with its own rule and accepts the longest
  prefix of drafts equal to those samples, so outputs are the tokens decoding gives, greedy or
  not. Its own drafter (method ``"mock"``) guesses its next tokens: ``{"num_tokens": N}`` (most
  drafts per step; default: as many as asked), ``"acceptance_rate": p`` or
  ``"acceptance_rates": [r1, r2, ...]`` (draft ``i`` is right with probability ``r_i`` given the
  drafts before it were; the last rate repeats; default 1), ``"wrong_positions": [i, ...]``
  (draft indices always wrong, for tests), ``"draft_latency": {"step_s", "per_token_s"}`` and
  ``"parallel_drafting"``: a step that asks for ``n`` drafts of ``B`` requests lasts
  ``(1 if parallel_drafting else n) * (step_s + per_token_s * B)`` longer. A stable hash of
  (request, position, draft index) decides which drafts are right: deterministic, whatever
  the batch. Drafts are scheduled tokens, so the latency model counts them.
  ``MockBackend.step_cost_model()`` gives the latency numbers to the speculation policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_core_mock._backend import FAULT_EXIT_CODE, MockBackend

__version__ = "0.1.0"
__all__ = ["FAULT_EXIT_CODE", "MockBackend"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package (as discovery does) stays cheap.
    if name in __all__:
        from engine_core_mock import _backend

        return getattr(_backend, name)
    raise AttributeError(f"module 'engine_core_mock' has no attribute {name!r}")
