"""Structured outputs on the mock backend, in process: grammars (JSON schema, regex, choice,
Lark/GBNF), compilation failures and timeouts, the cache, the bitmask row convention, grammar
rejection and completion, and the overlap of the bitmask with the forward pass."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_core_mock import MockBackend
from helpers.schemas import PERSON

from engine_core import LLM, SamplingParams, StructuredOutputsParams
from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, FinishedRequest
from engine_core._core.request import RequestStatus
from engine_core._engine.core import EngineCore
from engine_core.abc import ModelRunnerOutput, SchedulerOutput
from engine_core.config import EngineConfig

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(60)

MAX_STEPS = 5000
"""More steps than any test here needs: a request that never finishes fails the test."""

EOS = 257
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 7}, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
]


def _params(max_tokens: int = 200, **structured: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**structured),
    )


def _request(
    request_id: str, params: SamplingParams, prompt: bytes = b"hello"
) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt), params, eos_token_ids=[EOS])


def _run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, FinishedRequest]]:
    """Step until idle: tokens and finish entry of every request."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishedRequest] = {}
    for _ in _until_idle(core):
        _collect(core.step(), tokens, finished)
    return tokens, finished


def _until_idle(core: EngineCore) -> Iterator[None]:
    """One item per step to take while requests remain; fails after ``MAX_STEPS``."""
    for _ in range(MAX_STEPS):
        if not core.has_unfinished_requests():
            return
        yield None
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def _collect(
    out: EngineCoreOutputs, tokens: dict[str, list[int]], finished: dict[str, FinishedRequest]
) -> None:
    for rid, new in zip(out.req_ids, out.new_token_ids, strict=True):
        tokens.setdefault(rid, []).extend(new)
    for f in out.finished:
        finished[f.req_id] = f


def _allowed(row: Any) -> set[int]:
    return {j for j in range(len(row) * 32) if (int(row[j // 32]) >> (j % 32)) & 1}


# -- parameters ----------------------------------------------------------------------------------


def test_params_need_exactly_one_non_empty_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
        StructuredOutputsParams(json={"type": "string"}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.choice must not be empty"):
        StructuredOutputsParams(choice=[])


# -- outputs -------------------------------------------------------------------------------------


def test_choice_regex_and_grammars_greedy() -> None:
    # Greedy continues "hello" with "p": the mock takes the first allowed token at or after it.
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(
            ["hello"] * 5,
            [
                _params(choice=["yes", "no"]),
                _params(regex=r"[a-z]{3}-[0-9]{2}"),
                _params(grammar='start: "a" b\nb: "c"+ "d"'),
                _params(grammar='root ::= "x" [0-9]+ "y"'),
                _params(json_object=True),
            ],
            use_tqdm=False,
        )
    completions = [o.outputs[0] for o in outs]
    assert [c.text for c in completions] == ["yes", "pqr-01", "acd", "x0123456789y", '{"#":"#"}']
    assert completions[0].token_ids == [121, 101, 115, EOS]
    assert [(c.finish_reason, c.stop_reason) for c in completions] == [("stop", None)] * 5


def test_json_schema_outputs_parse_and_validate() -> None:
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(
            ["hello"] * len(SCHEMAS),
            [_params(json=s) for s in SCHEMAS],
            use_tqdm=False,
        )
    values = []
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        value = json.loads(out.outputs[0].text)
        jsonschema.validate(value, schema)
        values.append(value)
    assert values[0] == {"name": "#", "age": 0, "ok": False}
    assert values[4:] == ["ab", True]  # a string closes as soon as its pattern allows


def test_random_sampling_stays_in_the_grammar() -> None:
    regex = r"[a-z]{2,5}(-[0-9]{1,3})?"
    choices = ["!bang", "Zulu", "alpha", "~tilde", "\u00e9t\u00e9"]  # first bytes far apart
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=50,
            structured_outputs=StructuredOutputsParams(**kw),
        )
        for seed in range(8)
        for kw in ({"regex": regex}, {"choice": choices})
    ]
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(regex, t) for t in texts[0::2]), texts
    assert all(t in choices for t in texts[1::2]), texts
    assert len(set(texts[1::2])) > 1  # the seeds pick different choices
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}


def test_grammar_completion_stops_with_ignore_eos_and_min_tokens() -> None:
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(
            ["hello"] * 3,
            [
                _params(choice=["yes"]).clone(ignore_eos=True),
                _params(choice=["yes"]).clone(min_tokens=3),
                _params(choice=["yes"]).clone(min_tokens=5),
            ],
            use_tqdm=False,
        )
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == [
        ("yes", "stop"),
        ("yes", "stop"),
        ("yes", "error"),
    ]
    assert outs[0].outputs[0].token_ids == [121, 101, 115, EOS]
    assert outs[2].error == (
        "the structured_outputs grammar is complete after 3 tokens, fewer than min_tokens (5)"
    )


def test_hf_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world", "hello there", "say hello"], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    regex = r"hello [a-z]{1,5}!"
    # The mock's vocabulary (32000) is larger than the tokenizer's: the extra ids stay masked.
    with LLM(backend="mock", tokenizer=str(tmp_path), backend_options={"vocab_size": 32000}) as llm:
        outs = llm.generate(
            ["hello"] * 2,
            [_params(max_tokens=60, regex=regex), _params(choice=["hello world", "there"])],
            use_tqdm=False,
        )
    eos = tokenizer.token_to_id("</s>")
    assert re.fullmatch(regex, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].text in ("hello world", "there")
    assert [o.outputs[0].token_ids[-1] for o in outs] == [eos, eos]


# -- failures ------------------------------------------------------------------------------------


def test_malformed_specs_fail_alone() -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bad = [
        _params(json={"type": "nonsense"}),
        _params(json="{not json"),
        _params(regex="("),
        _params(grammar="start: ("),
        _params(choice=[""]),
    ]
    with LLM(backend="mock", tokenizer="byte") as llm:
        outs = llm.generate(
            ["abc", "abc", "abc", "abc", "abc", "abc", "hello"],
            [plain, *bad, _params(choice=["yes", "no"])],
            use_tqdm=False,
        )
        again = llm.generate(["abc"], plain, use_tqdm=False)[0]
    assert outs[0].outputs[0].text == "defg" and again.outputs[0].text == "defg"
    assert outs[-1].outputs[0].text == "yes"
    errors = [o.error for o in outs[1:-1]]
    assert [o.outputs[0].finish_reason for o in outs[1:-1]] == ["error"] * 5
    assert errors[0] == "invalid structured_outputs.json: Invalid type: nonsense"
    assert errors[1] == (
        "invalid structured_outputs.json: not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))"
    )
    assert errors[2] is not None and errors[2].startswith("invalid structured_outputs.regex: ")
    assert "unclosed group" in errors[2]
    assert errors[3] is not None and errors[3].startswith("invalid structured_outputs.grammar: ")
    assert errors[4] == "invalid structured_outputs.choice: it matches only the empty string"


class _IgnoresMask(MockBackend):
    """A backend that samples as if no grammar existed."""

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        return super().sample_tokens(None)


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error() -> None:
    core = EngineCore(
        EngineConfig(backend="mock", tokenizer="byte", async_scheduling=False),
        backend_cls=_IgnoresMask,
    )
    core.add_request(_request("c", _params(choice=["yes"])))
    core.add_request(_request("p", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    tokens, finished = _run(core)
    assert tokens == {"p": [112, 113]}  # the rejected token is not emitted
    assert finished["c"] == FinishedRequest(
        "c",
        "error",
        None,
        "the backend sampled token 112, which the structured_outputs grammar does not allow here",
    )
    assert core.scheduler.num_constrained == 0
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_without_llguidance_constrained_requests_fail_with_an_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte"))
    core.add_request(_request("c", _params(choice=["yes"])))
    core.add_request(_request("p", SamplingParams(temperature=0.0, max_tokens=1)))
    tokens, finished = _run(core)
    assert tokens == {"p": [112]}
    assert finished["c"].error == (
        "structured outputs need the llguidance and numpy packages (import of llguidance halted; "
        "None in sys.modules): pip install 'engine-core[structured]'"
    )


# -- compilation: cache, timeout, waiting --------------------------------------------------------


def test_cache_serves_equal_specs_and_remembers_failures() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte"))
    structured = core.structured_output
    core.add_request(_request("a", _params(json=PERSON)))
    core.add_request(_request("b", _params(json=PERSON)))  # joins the running compilation
    assert core.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_GRAMMAR
    tokens, _ = _run(core)
    assert structured.num_compiles == 1 and tokens["a"] == tokens["b"]
    # The same schema as JSON text with its keywords in another order: compiled already.
    reordered = json.dumps(dict(reversed(list(PERSON.items()))), indent=2)
    core.add_request(_request("c", _params(json=reordered)))
    assert core.scheduler.requests["c"].status == RequestStatus.WAITING
    assert structured.num_pending == 0 and structured.num_cache_hits == 1
    assert _run(core)[0]["c"] == tokens["a"]
    core.add_request(_request("bad1", _params(regex="(")))
    _, finished = _run(core)
    core.add_request(_request("bad2", _params(regex="(")))
    assert "bad2" not in core.scheduler.requests  # failed at once, from the cache
    _, finished2 = _run(core)
    assert finished2["bad2"].error == finished["bad1"].error
    assert structured.num_compiles == 2 and structured.num_cache_hits == 2


def test_properties_keep_their_order() -> None:
    """The grammar writes properties in the schema's order (``name`` before ``age``, as
    ``PERSON`` lists them, not sorted): a model that writes them so is never steered off its
    reply; the same properties in another order are another grammar."""
    reply = '{"name": "Ada", "age": 36, "ok": true}'
    options = {"replies": [{"match": "person", "text": reply}]}
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    with LLM(backend="mock", tokenizer="byte", backend_options=options) as llm:
        outs = llm.generate(
            ["a person", "a person", "hello"],
            [_params(json=PERSON), _params(json=reordered), _params(json=PERSON)],
            use_tqdm=False,
        )
    texts = [out.outputs[0].text for out in outs]
    assert texts[0] == reply
    assert list(json.loads(texts[1])) == ["ok", "age", "name"]
    assert list(json.loads(texts[2])) == ["name", "age", "ok"]  # the mock's own rule too


class _Gate:
    """Replaces grammar compilation with one that waits for the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import engine_core._structured.manager as module

        self.release = threading.Event()
        real = module.compile_grammar

        def blocked(tokenizer: Any, spec: Any) -> Any:
            if not self.release.wait(10):
                raise RuntimeError("the test never released the compilation")
            return real(tokenizer, spec)

        monkeypatch.setattr(module, "compile_grammar", blocked)


def test_compile_timeout_fails_only_that_request(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    now = [100.0]
    core = EngineCore(
        EngineConfig(backend="mock", tokenizer="byte", async_scheduling=False), clock=lambda: now[0]
    )
    core.structured_output.compile_timeout_s = 5.0
    core.add_request(_request("slow", _params(regex="[a-z]{3}")))
    core.add_request(_request("p", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishedRequest] = {}
    for _ in range(3):  # the waiting request does not hold up the plain one
        _collect(core.step(), tokens, finished)
        assert core.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert tokens == {"p": [112, 113, 114]} and list(finished) == ["p"]
    now[0] += 5.0
    _collect(core.step(), tokens, finished)
    assert finished["slow"] == FinishedRequest(
        "slow", "error", None, "the structured_outputs.regex grammar did not compile within 5 s"
    )
    assert not core.has_unfinished_requests() and core.scheduler.num_constrained == 0
    # The late compilation still fills the cache.
    gate.release.set()
    core.add_request(_request("later", _params(regex="[a-z]{3}")))
    assert _run(core)[0] == {"later": [112, 113, 114, EOS]}
    assert core.structured_output.num_compiles == 1


def test_abort_while_the_grammar_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate(monkeypatch)
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte"))
    core.add_request(_request("c", _params(regex="[a-z]{3}")))
    assert core.structured_output.num_pending == 1
    core.abort_requests(["c"])
    assert core.scheduler.num_constrained == 0
    assert core.grammar_wait_s() is None  # an idle engine does not wait for it
    assert not core.has_unfinished_requests()
    gate.release.set()
    core.close()


# -- the step: bitmask rows, overlap -------------------------------------------------------------


class _Recording(MockBackend):
    """Records each step's bitmask (shape, allowed tokens) and the times of its modelled device
    step (from the launch in ``execute_model`` until ``sample_tokens`` has its results)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.bitmasks: list[Any] = []
        self.forward: list[tuple[float, float]] = []
        self._launched = 0.0

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._launched = time.perf_counter()
        super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        if grammar_bitmask is None:
            self.bitmasks.append(None)
        else:
            assert grammar_bitmask.dtype.name == "int32"
            assert grammar_bitmask.flags["C_CONTIGUOUS"]
            self.bitmasks.append([_allowed(row) for row in grammar_bitmask])
        output = super().sample_tokens(grammar_bitmask)
        self.forward.append((self._launched, time.perf_counter()))
        return output


def test_bitmask_rows_are_the_constrained_requests_that_sample() -> None:
    config = EngineConfig(
        async_scheduling=False,
        backend="mock",
        tokenizer="byte",
        max_num_seqs=4,
        max_num_batched_tokens=8,
    )
    core = EngineCore(config, backend_cls=_Recording)
    backend = core.backend
    assert isinstance(backend, _Recording)
    core.add_request(_request("long", _params(choice=["yes", "no"]), prompt=b"0123456789"))
    core.step()  # waits for the grammar, then computes 8 of the 10 prompt tokens
    core.add_request(_request("plain", SamplingParams(temperature=0.0, max_tokens=3), b"ab"))
    tokens, _ = _run(core)
    core.add_request(_request("short", _params(regex="[a-c]+x"), prompt=b"q"))
    tokens2: dict[str, list[int]] = {}
    finished: dict[str, FinishedRequest] = {}
    _collect(core.step(), tokens2, finished)
    core.add_request(_request("plain2", SamplingParams(temperature=0.0, max_tokens=2), b"ab"))
    core.add_request(_request("short2", _params(regex="[a-c]+x"), prompt=b"a"))  # cached
    for _ in _until_idle(core):
        _collect(core.step(), tokens2, finished)
    abc, abcx, eos = {97, 98, 99}, {97, 98, 99, ord("x")}, {EOS}
    assert backend.bitmasks == [
        None,  # "long" on a partial prefill chunk: no row
        [{ord("y"), ord("n")}],  # "long" samples (and "plain", unconstrained: no row)
        [{ord("o")}],
        [eos],
        [abc],
        [abcx, abc],  # "short", then "short2" ("plain2" between them has no row)
        [abcx, abcx],
        [abcx, abcx],
        [eos, eos],
    ]
    assert tokens == {"long": [ord("n"), ord("o"), EOS], "plain": [99, 100, 101]}
    assert tokens2 == {
        "short": [97, 98, 99, ord("x"), EOS],
        "plain2": [99, 100],
        "short2": [98, 99, ord("x"), EOS],
    }
    assert {f.finish_reason for f in finished.values()} == {"stop", "length"}


class _GatedForward(MockBackend):
    """A forward pass that can only end once the bitmask fill has started."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.step_in_thread = True
        self.fill_started = threading.Event()
        self.saw_fill: list[bool] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        super().execute_model(scheduler_output)
        self.saw_fill.append(self.fill_started.wait(5))
        self.fill_started.clear()


def test_bitmask_is_filled_while_the_forward_pass_runs() -> None:
    core = EngineCore(
        EngineConfig(backend="mock", tokenizer="byte", async_scheduling=False),
        backend_cls=_GatedForward,
    )
    backend = core.backend
    assert isinstance(backend, _GatedForward)
    structured = core.structured_output
    fill = structured.fill_bitmask

    def signalling_fill(matchers: Any) -> Any:
        backend.fill_started.set()
        return fill(matchers)

    structured.fill_bitmask = signalling_fill  # type: ignore[method-assign]
    core.add_request(_request("c", _params(choice=["yes"])))
    tokens, _ = _run(core)
    assert tokens == {"c": [121, 101, 115, EOS]}
    assert backend.saw_fill == [True] * 4


def test_with_step_latency_the_step_lasts_the_longer_of_forward_and_bitmask() -> None:
    step_s = fill_s = 0.05
    config = EngineConfig(
        async_scheduling=False,
        backend="mock",
        tokenizer="byte",
        backend_options={"latency": {"step_s": step_s}},
    )
    core = EngineCore(config, backend_cls=_Recording)
    backend = core.backend
    assert isinstance(backend, _Recording)
    structured = core.structured_output
    fill = structured.fill_bitmask
    fills: list[tuple[float, float]] = []

    def slow_fill(matchers: Any) -> Any:
        start = time.perf_counter()
        time.sleep(fill_s)
        bitmask = fill(matchers)
        fills.append((start, time.perf_counter()))
        return bitmask

    structured.fill_bitmask = slow_fill  # type: ignore[method-assign]
    core.add_request(_request("c", _params(choice=["yes"])))
    core.step()  # compiles the grammar (the step waits for it), then runs
    durations = []
    for _ in _until_idle(core):
        start = time.perf_counter()
        core.step()
        durations.append(time.perf_counter() - start)
    assert len(fills) == len(backend.forward) == 4
    for (fill_start, _), (forward_start, forward_end) in zip(fills, backend.forward, strict=True):
        assert forward_start - 0.01 <= fill_start < forward_end
    # One after the other they would take at least step_s + fill_s.
    assert all(d < step_s + fill_s for d in durations), durations


def test_preempted_constrained_requests_resume_in_their_grammar() -> None:
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        async_scheduling=False,
        num_kv_blocks=8,
        block_size=16,
        preemption_victim="last_admitted",  # the victims below
    )
    core = EngineCore(config)
    for i in range(4):
        core.add_request(_request(f"r{i}", _params(regex="[a-z]{40}"), prompt=b"x" * (i + 1)))
    requests = dict(core.scheduler.requests)
    tokens, finished = _run(core)
    # At 32 tokens each needs a third block; eight blocks give three to two of them: the two
    # admitted last are preempted, once each.
    preempted = {rid: request.num_preemptions for rid, request in requests.items()}
    assert preempted == {"r0": 0, "r1": 0, "r2": 1, "r3": 1}
    assert core.scheduler.num_preemptions == 2
    letters = [ord("a") + (ord("y") - ord("a") + k) % 26 for k in range(40)]
    assert tokens == {f"r{i}": letters + [EOS] for i in range(4)}
    assert {f.finish_reason for f in finished.values()} == {"stop"}
    assert core.scheduler.kv.num_free_blocks == 8


def test_plain_serving_loads_no_grammar_library() -> None:
    code = (
        "import sys; from engine_core import LLM, SamplingParams\n"
        "with LLM(backend='mock', tokenizer='byte') as llm:\n"
        "    params = SamplingParams(temperature=0.0, max_tokens=3)\n"
        "    out = llm.generate(['abc'], params, use_tqdm=False)\n"
        "assert out[0].outputs[0].text == 'def', out\n"
        "loaded = [m for m in ('llguidance', 'numpy') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compile_timeout_comes_from_the_engine_config() -> None:
    from engine_core._engine.core import EngineCore
    from engine_core.config import EngineConfig

    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", grammar_compile_timeout_s=2.5))
    assert core.structured_output.compile_timeout_s == 2.5
    with pytest.raises(ValueError, match="grammar_compile_timeout_s must be > 0"):
        EngineConfig(grammar_compile_timeout_s=0)


def test_disable_any_whitespace_keys_its_own_json_grammar() -> None:
    from engine_core._structured.grammar import GrammarSpec

    schema = {"type": "object"}
    flexible = GrammarSpec.from_params(StructuredOutputsParams(json=schema))
    compact = GrammarSpec.from_params(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    )
    assert (flexible.compact, compact.compact) == (False, True) and flexible != compact
    assert GrammarSpec.from_params(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    ).compact
    # Other grammars have no JSON whitespace to drop: one cache entry either way.
    assert GrammarSpec.from_params(
        StructuredOutputsParams(regex="a+", disable_any_whitespace=True)
    ) == GrammarSpec.from_params(StructuredOutputsParams(regex="a+"))
    with pytest.raises(TypeError, match="disable_any_whitespace must be a bool"):
        StructuredOutputsParams(json=schema, disable_any_whitespace=1)  # type: ignore[arg-type]
