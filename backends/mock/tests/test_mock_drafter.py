"""The mock's drafter as a pure function: its acceptance model, scripted errors, latency model
and options; and the ``copy_prompt`` rule."""

from __future__ import annotations

import pytest
from engine_core_mock._copy import CopyRule, parse_copy
from engine_core_mock._drafter import (
    Drafter,
    DraftLatency,
    SpecOptions,
    draft_is_right,
    expected_acceptance_length,
    parse_spec,
    request_key,
)
from mock_driver import Driver

VOCAB = 32000


def _count_up(start: int) -> object:
    """The mock's greedy rule after a history ending in ``start - 1``."""
    return lambda extra: (start + len(extra)) % VOCAB


def _acceptance_lengths(drafter: Drafter, k: int, num_requests: int, steps: int) -> list[int]:
    """Accepted drafts + 1 of every step, for requests counting up from token 7: exact
    verification accepts the drafts equal to the mock's own tokens, up to the first other."""
    lengths = []
    for r in range(num_requests):
        key = request_key(f"req-{r}")
        position = 32
        for _ in range(steps):
            own = 7 + position
            drafts = drafter.propose(key, position, k, _count_up(own))  # type: ignore[arg-type]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == (own + accepted) % VOCAB:
                accepted += 1
            lengths.append(accepted + 1)
            position += accepted + 1
    return lengths


@pytest.mark.parametrize("p", [0.5, 0.7, 0.9])
def test_mean_acceptance_length_is_within_3_percent_of_the_model(p: float) -> None:
    k = 4
    lengths = _acceptance_lengths(Drafter(SpecOptions(k, (p,)), VOCAB), k, 100, 120)
    assert len(lengths) >= 10_000
    model = (1 - p ** (k + 1)) / (1 - p)
    assert expected_acceptance_length([p], k) == pytest.approx(model)
    mean = sum(lengths) / len(lengths)
    assert abs(mean / model - 1) <= 0.03, (mean, model)


def test_per_position_rates_are_conditional() -> None:
    rates = (0.9, 0.8, 0.5, 0.3)
    lengths = _acceptance_lengths(Drafter(SpecOptions(4, rates), VOCAB), 4, 100, 120)
    model = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.5 + 0.9 * 0.8 * 0.5 * 0.3
    assert expected_acceptance_length(rates, 4) == pytest.approx(model)
    assert abs(sum(lengths) / len(lengths) / model - 1) <= 0.03
    # P(draft 3 right | drafts 1 and 2 right) is the third rate.
    reached_3 = sum(1 for n in lengths if n >= 3)
    passed_3 = sum(1 for n in lengths if n >= 4)
    assert passed_3 / reached_3 == pytest.approx(0.5, abs=0.03)


def test_rates_zero_and_one() -> None:
    assert set(_acceptance_lengths(Drafter(SpecOptions(3, (1.0,)), VOCAB), 3, 5, 20)) == {4}
    assert set(_acceptance_lengths(Drafter(SpecOptions(3, (0.0,)), VOCAB), 3, 5, 20)) == {1}


def test_wrong_positions_script_the_first_error() -> None:
    options = SpecOptions(4, (1.0,), frozenset({3}))
    drafter = Drafter(options, VOCAB)
    drafts = drafter.propose(request_key("r"), 10, 4, _count_up(100))  # type: ignore[arg-type]
    assert drafts[:2] == [100, 101]
    assert drafts[2] != 102
    assert drafts[3] == 103  # after a wrong draft the drafter still guesses the rule's token
    assert set(_acceptance_lengths(drafter, 4, 5, 20)) == {3}


def test_drafts_are_deterministic_and_capped() -> None:
    drafter = Drafter(SpecOptions(3, (0.5,)), VOCAB)
    key = request_key("a")
    first = drafter.propose(key, 40, 8, _count_up(5))  # type: ignore[arg-type]
    assert len(first) == 3  # num_tokens caps what is asked
    assert drafter.propose(key, 40, 8, _count_up(5)) == first  # type: ignore[arg-type]
    assert drafter.propose(key, 40, 2, _count_up(5)) == first[:2]  # type: ignore[arg-type]
    # Another request draws its own.
    draws = {
        tuple(drafter.propose(request_key(f"r{i}"), 40, 3, _count_up(5)))  # type: ignore[arg-type]
        for i in range(20)
    }
    assert len(draws) > 1


def test_a_wrong_draft_is_never_the_own_token() -> None:
    drafter = Drafter(SpecOptions(1, (0.0,)), 2)  # two tokens: the other one
    for position in range(50):
        assert drafter.propose(7, position, 1, lambda extra: 1) == [0]
    drafter = Drafter(SpecOptions(1, (0.0,)), VOCAB)
    for position in range(200):
        assert drafter.propose(7, position, 1, lambda extra: VOCAB - 1) != [VOCAB - 1]


def test_draft_is_right_is_a_stable_uniform_draw() -> None:
    key = request_key("req")
    hits = sum(draft_is_right(key, pos, 1, 0.25) for pos in range(20_000))
    assert hits / 20_000 == pytest.approx(0.25, abs=0.01)
    assert [draft_is_right(key, pos, 2, 0.5) for pos in range(30)] == [
        draft_is_right(key, pos, 2, 0.5) for pos in range(30)
    ]
    assert request_key("req") == request_key("req") != request_key("req2")


def test_draft_latency() -> None:
    latency = DraftLatency(step_s=0.001, per_token_s=0.0001)
    assert latency.duration(4, 10, parallel=False) == pytest.approx(4 * 0.002)
    assert latency.duration(4, 10, parallel=True) == pytest.approx(0.002)
    assert latency.duration(0, 10, parallel=False) == 0.0
    assert latency.duration(4, 0, parallel=True) == 0.0


def test_parse_spec() -> None:
    assert parse_spec(None) is None
    assert parse_spec({}) == SpecOptions()
    options = parse_spec(
        {
            "num_tokens": 6,
            "acceptance_rates": [0.9, 0.5],
            "wrong_positions": [2],
            "draft_latency": {"step_s": 0.001},
            "parallel_drafting": True,
        }
    )
    assert options == SpecOptions(
        6, (0.9, 0.5), frozenset({2}), DraftLatency(step_s=0.001), parallel_drafting=True
    )
    assert [options.rate(i) for i in (1, 2, 3, 6)] == [0.9, 0.0, 0.5, 0.5]
    bad = [
        ({"bogus": 1}, r"unknown key\(s\) \['bogus'\]"),
        ({"num_tokens": 0}, r"'num_tokens'\] must be an int >= 1, got 0"),
        ({"acceptance_rate": 1.5}, r"'acceptance_rate'\] must be a number in \[0, 1\], got 1.5"),
        ({"acceptance_rate": 0.5, "acceptance_rates": [0.5]}, "not both"),
        ({"acceptance_rates": []}, "must be a non-empty list"),
        ({"acceptance_rates": [0.5, -1]}, r"'acceptance_rates'\]\[1\] must be a number"),
        ({"wrong_positions": [0]}, "must be a list of draft indices >= 1"),
        ({"parallel_drafting": 1}, "must be a bool"),
        ({"draft_latency": {"step": 1}}, "must be a dict with the keys step_s, per_token_s"),
        ({"draft_latency": {"step_s": -1}}, r"\['step_s'\] must be a finite number >= 0"),
        ([], "must be a dict"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_spec(value)


def test_copy_rule_copies_spans_of_the_prompt() -> None:
    prompt = list(range(1000, 1100))
    rule = CopyRule(0.75, 8)
    assert rule.num_copied == 6
    tokens = [rule.token(prompt, len(prompt), i) for i in range(32)]
    for period in range(4):
        span = tokens[period * 8 : (period + 1) * 8]
        assert span[:2] == [None, None]  # the rule's tokens first
        copied = [t for t in span[2:] if t is not None]
        assert len(copied) == 6
        start = copied[0] - 1000
        assert copied == prompt[start : start + 6]  # one contiguous span of the prompt
    starts = {tokens[p * 8 + 2] for p in range(4)}
    assert len(starts) > 1  # spans start at different places
    # A prompt shorter than a span wraps around.
    short = [5, 6, 7]
    assert all(CopyRule(1.0, 8).token(short, 3, i) in short for i in range(8))
    assert parse_copy({"fraction": 0.75, "period": 64}) == CopyRule(0.75, 64)
    assert parse_copy(None) is None
    with pytest.raises(ValueError, match="keys 'fraction' and 'period'"):
        parse_copy({"fraction": 0.5})
    with pytest.raises(ValueError, match=r"'fraction'\] must be a number in \[0, 1\]"):
        parse_copy({"fraction": 2, "period": 4})
    with pytest.raises(ValueError, match=r"'period'\] must be an int >= 1"):
        parse_copy({"fraction": 0.5, "period": 0})


def test_the_backend_copies_the_prompt_greedy_or_not() -> None:
    prompt = list(range(1000, 1100))
    rule = CopyRule(0.5, 8)
    for params in ({}, {"temperature": 1.0, "seed": 3}):
        d = Driver(vocab_size=VOCAB, copy_prompt={"fraction": 0.5, "period": 8})
        tokens = d.run([d.new("r", prompt, **params)], 24)["r"]
        history = list(prompt)
        for index, token in enumerate(tokens):
            copied = rule.token(history, len(prompt), index)
            if copied is not None:
                assert token == copied
            elif not params:
                assert token == history[-1] + 1  # the rule: count up
            history.append(token)
