"""Parts of the server that need no server: chat templates, metrics, parameter errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_core._core.engine_io import EngineStats, KVGroupStats
from engine_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine_core.server import DEFAULT_CHAT_TEMPLATE, ServerSettings, load_chat_template
from engine_core.server._chat_template import ChatTemplateError
from engine_core.server._errors import invalid_parameter
from engine_core.server._metrics import Histogram, ServerMetrics
from engine_core.server._protocol import CompletionRequest
from engine_core.server._run import http_server_for

HI = [{"role": "user", "content": "hi"}]

# -- chat templates ------------------------------------------------------------------------------

LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_byte_tokenizer_gets_the_plain_default() -> None:
    template = load_chat_template("byte")
    assert template.source == DEFAULT_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, *HI]
    assert template.render(messages) == "system: be brief\nuser: hi\nassistant:"
    assert template.render(HI, add_generation_prompt=False) == "user: hi\n"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_renders_like_jinja(add_generation_prompt: bool) -> None:
    template = load_chat_template("byte")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "two\nlines"},
        {"role": "assistant", "content": ""},
    ]
    expected = template._template.render(  # what Jinja makes of the same template
        messages=messages, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    config = {
        "chat_template": LLAMA_LIKE,
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(str(tmp_path))
    assert template.render(HI) == "<s><|user|>hi</s><|assistant|>"


def test_named_templates_use_default_and_jinja_file_wins(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(str(tmp_path)).render(HI) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(str(tmp_path)).render(HI) == "J1"


def test_override_is_a_file_or_the_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("F{{ messages[0]['content'] }}")
    assert load_chat_template("byte", str(path)).render(HI) == "Fhi"
    assert load_chat_template("byte", "T{{ messages | tojson }}").render(HI) == (
        'T[{"role": "user", "content": "hi"}]'
    )


def test_directory_without_template_falls_back_to_default(tmp_path: Path) -> None:
    assert load_chat_template(str(tmp_path)).source == DEFAULT_CHAT_TEMPLATE


def test_template_errors_and_continue_final_message() -> None:
    strict = load_chat_template(
        "byte",
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}",
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    template = load_chat_template("byte")
    partial = [*HI, {"role": "assistant", "content": "The answer is"}]
    text = template.render(partial, add_generation_prompt=False, continue_final_message=True)
    assert text == "user: hi\nassistant: The answer is"
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template.render(partial, continue_final_message=True)


def test_sandbox_blocks_attribute_escapes() -> None:
    template = load_chat_template("byte", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render(HI)


# -- metrics -------------------------------------------------------------------------------------


def _output(
    tokens: list[int],
    *,
    finish: str | None,
    first: float,
    last: float,
    finished: float | None = None,
    index: int = 0,
) -> RequestOutput:
    return RequestOutput(
        "r",
        "abc",
        [1, 2, 3],
        [CompletionOutput(index, "x" * len(tokens), tokens, finish_reason=finish)],  # type: ignore[arg-type]
        finished=finish is not None,
        metrics=RequestMetrics(10.0, first, last, finished),
    )


def _samples(metrics: ServerMetrics, stats: EngineStats | None = None) -> dict[str, float]:
    text = metrics.render(stats).decode()
    return {
        s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _expect(samples: dict[str, float], expected: dict[str, object]) -> None:
    """``samples`` has the ``expected`` values (each compared with ``==``)."""
    assert {name: samples.get(name) for name in expected} == expected


def test_recorder_counts_tokens_latencies_and_finish_reasons() -> None:
    metrics = ServerMetrics()
    recorder = metrics.recorder()
    # 3 tokens arrive together (first at 10.5, last at 10.75), then 2 more at 11.25.
    recorder.observe(_output([1, 2, 3], finish=None, first=10.5, last=10.75))
    recorder.observe(_output([4, 5], finish="length", first=10.5, last=11.25, finished=11.25))
    recorder.close(1)
    s = _samples(metrics)
    itl = "engine_core_inter_token_latency_seconds"
    _expect(
        s,
        {
            "engine_core_prompt_tokens_total": 3,
            "engine_core_generation_tokens_total": 5,
            "engine_core_request_success_total|finished_reason=length": 1,
            "engine_core_time_to_first_token_seconds_count": 1,
            "engine_core_time_to_first_token_seconds_sum": pytest.approx(0.5),
            # Gaps: 2 of 0.125 s (tokens 2 and 3), then 2 of 0.25 s (tokens 4 and 5).
            f"{itl}_count": 4,
            f"{itl}_sum": 0.75,
            f"{itl}_bucket|le=0.1": 0,
            f"{itl}_bucket|le=0.15": 2,
            f"{itl}_bucket|le=0.2": 2,
            f"{itl}_bucket|le=0.3": 4,
            "engine_core_e2e_request_latency_seconds_sum": 1.25,
        },
    )
    assert "engine_core_num_requests_running" not in s


def test_recorder_counts_unfinished_completions_as_aborted() -> None:
    metrics = ServerMetrics()
    recorder = metrics.recorder()
    recorder.observe(_output([1], finish="stop", first=10.1, last=10.1, finished=10.1))
    recorder.close(3)  # n=3: two completions never finished (the client went away)
    recorder.close(3)
    never_admitted = metrics.recorder()
    never_admitted.close(1)
    s = _samples(metrics)
    assert s["engine_core_request_success_total|finished_reason=stop"] == 1
    assert s["engine_core_request_success_total|finished_reason=abort"] == 2


def _stats(**fields: Any) -> EngineStats:
    """An engine's stats: one request running, 25 of 100 blocks in use after 9 steps, but for
    ``fields``."""
    defaults: dict[str, Any] = {
        "num_running": 1,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_cache_hit_rate": 0.0,
        "num_preemptions": 0,
        "num_steps": 9,
        "num_kv_blocks": 100,
        "num_free_kv_blocks": 75,
    }
    return EngineStats(**(defaults | fields))


def test_engine_state_comes_from_the_stats() -> None:
    # (metric, the EngineStats field it shows, a value)
    shown: list[tuple[str, str, float]] = [
        ("engine_core_num_requests_running", "num_running", 3),
        ("engine_core_num_requests_waiting", "num_waiting", 2),
        ("engine_core_kv_cache_usage_perc", "kv_cache_usage", 0.25),
        ("engine_core_prefix_cache_hit_rate", "prefix_cache_hit_rate", 0.5),
        ("engine_core_num_preemptions_total", "num_preemptions", 4),
        ("engine_core_prefix_cache_queries_total", "prefix_cache_queries", 40),
        ("engine_core_prefix_cache_hits_total", "prefix_cache_hits", 20),
        ("engine_core_malformed_messages_total", "num_malformed_messages", 2),
        ("engine_core_device_busy_seconds_total", "device_busy_s", 1.5),
    ]
    fields: dict[str, Any] = {field: value for _, field, value in shown}
    stats = _stats(**fields)
    _expect(_samples(ServerMetrics(), stats), {metric: value for metric, _, value in shown})


def test_kv_group_blocks_are_a_series_per_group() -> None:
    groups = [
        KVGroupStats(kind="full_attention", window=None, blocks_in_use=30),
        KVGroupStats(kind="sliding_attention", window=128, blocks_in_use=4),
    ]
    stats = _stats(kv_cache_usage=0.34, num_free_kv_blocks=66, kv_groups=groups)
    s = _samples(ServerMetrics(), stats)
    name = "engine_core_kv_group_blocks_in_use"
    assert s[f"{name}|group=0|kind=full_attention|window="] == 30
    assert s[f"{name}|group=1|kind=sliding_attention|window=128"] == 4


def test_speculative_decoding_series_use_vllms_names() -> None:
    stats = _stats(
        spec_num_speculative_tokens=2,
        spec_num_drafts=5,
        spec_num_draft_tokens=9,
        spec_num_accepted_tokens=6,
        spec_accepted_per_pos=[4, 2],
        spec_drafted_per_pos=[5, 4],
        spec_current_k=2,
        spec_steps_by_k={0: 3, 2: 6},
    )
    _expect(
        _samples(ServerMetrics(), stats),
        {
            "engine_core_spec_decode_num_drafts_total": 5,
            "engine_core_spec_decode_num_draft_tokens_total": 9,
            "engine_core_spec_decode_num_accepted_tokens_total": 6,
            "engine_core_spec_decode_num_accepted_tokens_per_pos_total|position=0": 4,
            "engine_core_spec_decode_num_accepted_tokens_per_pos_total|position=1": 2,
            "engine_core_spec_decode_k": 2,
            "engine_core_spec_decode_steps_total|k=0": 3,
            "engine_core_spec_decode_steps_total|k=2": 6,
            "engine_core_spec_decode_wasted_tokens_total": 3,
        },
    )
    # Off: no series at all.
    off = msgspec.structs.replace(stats, spec_num_speculative_tokens=0)
    assert not any("spec_decode" in name for name in _samples(ServerMetrics(), off))
    # Data parallelism: one series per engine.
    dp = msgspec.structs.replace(stats, engines=[stats, stats], engine_ranks=[0, 1])
    samples = _samples(ServerMetrics(), dp)
    assert samples["engine_core_spec_decode_num_drafts_total|engine=1"] == 5
    assert samples["engine_core_spec_decode_steps_total|engine=0|k=2"] == 6


def test_histogram_observes_many_equal_values_at_once() -> None:
    histogram = Histogram((0.1, 1.0))
    histogram.observe(0.05, 3)
    histogram.observe(0.5)
    histogram.observe(7.0)
    assert histogram.counts == [3, 1, 1]
    assert (histogram.count, histogram.sum) == (5, pytest.approx(7.65))


# -- errors and settings -------------------------------------------------------------------------


def test_invalid_parameter_names_the_field() -> None:
    fields = CompletionRequest.__struct_fields__
    error = invalid_parameter(ValueError("temperature must be in [0, 2], got 3"), fields)
    assert (error.status, error.param) == (400, "temperature")
    renamed = invalid_parameter(
        ValueError("logprobs must be in [0, 20]"), fields, {"logprobs": "x"}
    )
    assert renamed.param is None  # "x" is not a field of the request
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"prompt": "a", "top_p": "high"}', type=CompletionRequest)
    assert invalid_parameter(info.value, fields).param == "top_p"
    assert invalid_parameter(ValueError("the prompt is empty"), fields).param is None


def test_http_server_choice() -> None:
    auto = ServerSettings()
    assert http_server_for(auto, "asyncio") == "uvicorn"  # installed with the server extra
    assert http_server_for(auto, "trio") == "hypercorn"
    assert http_server_for(ServerSettings(http_server="hypercorn"), "asyncio") == "hypercorn"
    with pytest.raises(ValueError, match="asyncio only"):
        http_server_for(ServerSettings(http_server="uvicorn"), "trio")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 70000),
        ("max_request_body_bytes", 0),
        ("api_key", ""),
        ("health_timeout_s", 0),
        ("http_server", "gunicorn"),
    ],
)
def test_settings_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})  # type: ignore[arg-type]
