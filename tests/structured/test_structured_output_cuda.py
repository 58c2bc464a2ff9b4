"""Structured outputs with the CUDA backend on the CPU (torch kernels), on the tiny random Llama
of the backend's own tests: the bitmask is applied to real logits on the device."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_core import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("engine_core_cuda")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CUDA_TESTS = Path(__file__).resolve().parents[2] / "backends" / "cuda" / "tests"
if not (CUDA_TESTS / "tiny_models.py").is_file():
    pytest.skip("the CUDA backend's tiny models are not here", allow_module_level=True)

EOS = 1  # "</s>" of the tiny tokenizer
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
    # A random model would emit whitespace forever where JSON allows any.
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"[a-z]{2,6} [0-9]{1,3}"
CHOICES = ["engine", "token cache", "graph"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    from engine_core_cuda._options import DEVICE_ENV

    sys.path.insert(0, str(CUDA_TESTS))
    try:
        import tiny_models
    finally:
        sys.path.remove(str(CUDA_TESTS))
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_models.build("llama", path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEVICE_ENV, "cpu")
        with LLM(
            model=str(path),
            backend="cuda",
            backend_options={"device": "cpu", "kernels": "torch"},
            max_model_len=256,
            num_kv_blocks=96,
        ) as engine:
            yield engine


def test_outputs_follow_the_grammar(llm: LLM) -> None:
    specs: list[dict[str, Any]] = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(**spec),
        )
        for temperature, seed in [(0.0, None), (0.8, 1), (0.8, 2)]
        for spec in specs
    ]
    prompts = ["the engine", "a block of", "the model"] * 3
    outs = llm.generate(prompts, params, use_tqdm=False)
    completions = [o.outputs[0] for o in outs]
    assert [c.finish_reason for c in completions] == ["stop"] * 9, [c.text for c in completions]
    assert [c.token_ids[-1] for c in completions] == [EOS] * 9
    for c in completions[0::3]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for c in completions[1::3]:
        assert re.fullmatch(REGEX, c.text), c.text
    for c in completions[2::3]:
        assert c.text in CHOICES


def test_unconstrained_greedy_output_breaks_the_grammar(llm: LLM) -> None:
    # So the grammar, not the model, shaped the outputs above.
    out = llm.generate(
        ["the engine"], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )[0].outputs[0]
    assert not re.fullmatch(REGEX, out.text) and out.text not in CHOICES
