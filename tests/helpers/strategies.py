"""Hypothesis strategies for what callers pass: ``SamplingParams`` fields and hostile values."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from engine_core.sampling_params import RequestOutputKind

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.sampled_from([0, 1, -1, 2, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(exclude_categories=()), max_size=5),
    st.binary(max_size=3),
    st.lists(st.integers(-(2**70), 2**70), max_size=3),
    st.lists(st.one_of(st.integers(-3, 300), st.integers(), st.text(max_size=3)), max_size=4),
    st.tuples(st.text(max_size=2)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(list(RequestOutputKind)),
)
"""Values of every type a careless or hostile caller might pass for any field or argument."""

SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 4),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 2**63 - 1),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "max_tokens": st.integers(1, 2**63 - 1),
    "min_tokens": st.integers(0, 8),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2**63 - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.integers(0, 20),
    "prompt_logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 10.0),
    "output_kind": st.one_of(st.sampled_from(list(RequestOutputKind)), st.integers(0, 2)),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "logit_bias": st.one_of(
        st.none(),
        st.dictionaries(st.integers(0, 2**63 - 1), st.floats(-100.0, 100.0), max_size=3),
    ),
}
"""Each ``SamplingParams`` field but ``structured_outputs`` (whose tests build their own): values
of its type in its valid range, up to the limits of the wire. A combination may still be invalid
(``min_tokens`` above ``max_tokens``, stop strings without detokenize)."""
