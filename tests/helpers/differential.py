"""What the front-end differential tests share: one engine against another (async scheduling
against synchronous, speculation against none) on the same random requests through ``LLM``, with
few KV blocks (preemption) and a small token budget (chunked prefill)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from engine_core import SamplingParams
from engine_core.sampling_params import StructuredOutputsParams

ENGINE: dict[str, Any] = {
    "backend": "mock",
    "tokenizer": "byte",
    "max_model_len": 96,
    "num_kv_blocks": 24,  # few: requests get preempted
    "block_size": 8,
    "max_num_batched_tokens": 32,  # long prompts are chunked
    "max_num_seqs": 8,
}


@st.composite
def sampling_params(draw: st.DrawFn, *, min_tokens: bool = False) -> SamplingParams:
    """n > 1, greedy or seeded, stop strings, logprobs, prompt logprobs, choices; ``min_tokens``:
    draw that too."""
    n = draw(st.integers(1, 3))
    choice = st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=3)
    structured = draw(
        st.one_of(st.none(), st.none(), st.builds(StructuredOutputsParams, choice=choice))
    )
    max_tokens = draw(st.integers(1, 30))
    return SamplingParams(
        n=n,
        temperature=0.9 if n > 1 else draw(st.sampled_from([0.0, 0.9])),  # greedy: n = 1
        seed=draw(st.integers(0, 5)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(3, max_tokens))) if min_tokens else 0,
        stop=draw(st.lists(st.text("defghijk", min_size=1, max_size=2), max_size=2)),
        include_stop_str_in_output=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 2))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 1))),
        structured_outputs=structured,
    )


def prompts(prefixes: list[str]) -> st.SearchStrategy[list[tuple[str, str]]]:
    """One to six (prefix, body) pairs; a prompt is their concatenation, or "x" when empty."""
    return st.lists(
        st.tuples(st.sampled_from(prefixes), st.text("abcdef", max_size=40)),
        min_size=1,
        max_size=6,
    )


def summary(outputs: list[Any], *, error_text: bool = True) -> list[Any]:
    """What must be equal between the two engines, per request; without ``error_text`` only
    whether it failed."""
    return [
        (
            o.error if error_text else o.error is None,
            o.prompt_logprobs,
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs],
        )
        for o in outputs
    ]
