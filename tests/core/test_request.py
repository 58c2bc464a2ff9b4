"""The request state machine, its derived values and its prefix-cache block keys."""

from __future__ import annotations

import itertools

import pytest
from helpers.core import make_request

from engine_core._core.block_hash import NONE_HASH, block_keys, extra_key_bytes
from engine_core._core.request import (
    ALLOWED_TRANSITIONS,
    FINISH_REASONS,
    InvalidTransition,
    Request,
    RequestStatus,
)
from engine_core.sampling_params import SamplingParams

S = RequestStatus
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1 << 20

# Written out by hand (not derived from the module) so that a change to the table shows up here.
EXPECTED_TRANSITIONS = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.WAITING, S.FINISHED_ERROR),
    (S.WAITING_FOR_GRAMMAR, S.WAITING),
    (S.WAITING_FOR_GRAMMAR, S.FINISHED_ABORTED),
    (S.WAITING_FOR_GRAMMAR, S.FINISHED_ERROR),
    (S.RUNNING, S.PREEMPTED),
    (S.RUNNING, S.FINISHED_STOPPED),
    (S.RUNNING, S.FINISHED_LENGTH_CAPPED),
    (S.RUNNING, S.FINISHED_ABORTED),
    (S.RUNNING, S.FINISHED_ERROR),
    (S.PREEMPTED, S.RUNNING),
    (S.WAITING, S.WAITING_FOR_REMOTE_KVS),
    (S.PREEMPTED, S.WAITING_FOR_REMOTE_KVS),
    (S.WAITING_FOR_REMOTE_KVS, S.WAITING),
    (S.WAITING_FOR_REMOTE_KVS, S.FINISHED_ABORTED),
    (S.WAITING_FOR_REMOTE_KVS, S.FINISHED_ERROR),
    (S.PREEMPTED, S.FINISHED_STOPPED),
    (S.PREEMPTED, S.FINISHED_LENGTH_CAPPED),
    (S.PREEMPTED, S.FINISHED_ABORTED),
    (S.PREEMPTED, S.FINISHED_ERROR),
}


# -- RequestStatus --------------------------------------------------------------------------------


def test_status_order_puts_finished_states_after_preempted() -> None:
    assert [s.name for s in sorted(RequestStatus)] == [
        "WAITING",
        "WAITING_FOR_GRAMMAR",
        "RUNNING",
        "WAITING_FOR_REMOTE_KVS",
        "PREEMPTED",
        "FINISHED_STOPPED",
        "FINISHED_LENGTH_CAPPED",
        "FINISHED_ABORTED",
        "FINISHED_ERROR",
    ]
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {s for s in RequestStatus if s > S.PREEMPTED}
    assert finished == {
        S.FINISHED_STOPPED,
        S.FINISHED_LENGTH_CAPPED,
        S.FINISHED_ABORTED,
        S.FINISHED_ERROR,
    }


def test_finish_reason_map() -> None:
    assert FINISH_REASONS == {
        S.FINISHED_STOPPED: "stop",
        S.FINISHED_LENGTH_CAPPED: "length",
        S.FINISHED_ABORTED: "abort",
        S.FINISHED_ERROR: "error",
    }
    for status in (
        S.WAITING,
        S.WAITING_FOR_GRAMMAR,
        S.RUNNING,
        S.WAITING_FOR_REMOTE_KVS,
        S.PREEMPTED,
    ):
        assert status.finish_reason is None
    assert S.FINISHED_STOPPED.finish_reason == "stop"
    assert S.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert S.FINISHED_ABORTED.finish_reason == "abort"
    assert S.FINISHED_ERROR.finish_reason == "error"


def test_transition_table_is_exactly_the_expected_one() -> None:
    table = {(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in targets}
    assert table == EXPECTED_TRANSITIONS
    assert set(ALLOWED_TRANSITIONS) == set(RequestStatus)


@pytest.mark.parametrize("old,new", sorted(EXPECTED_TRANSITIONS))
def test_allowed_transition(old: RequestStatus, new: RequestStatus) -> None:
    request = make_request()
    request.status = old
    request.set_status(new)
    assert request.status is new
    assert request.is_finished == (new > S.PREEMPTED)
    assert request.finish_reason == FINISH_REASONS.get(new)


@pytest.mark.parametrize(
    "old,new",
    [p for p in itertools.product(RequestStatus, RequestStatus) if p not in EXPECTED_TRANSITIONS],
)
def test_every_other_transition_raises(old: RequestStatus, new: RequestStatus) -> None:
    request = make_request(request_id="bad")
    request.status = old
    with pytest.raises(InvalidTransition, match=f"'bad': {old.name} -> {new.name}"):
        request.set_status(new)
    assert request.status is old


def test_full_life_cycle() -> None:
    request = make_request()
    assert request.status is S.WAITING
    for status in (S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_STOPPED):
        request.set_status(status)
    assert request.is_finished
    assert request.finish_reason == "stop"


# -- derived values -------------------------------------------------------------------------------


def test_counters_follow_appended_tokens() -> None:
    request = make_request(prompt=[5, 6, 7])
    assert request.num_prompt_tokens == 3
    assert request.num_tokens == 3
    assert request.num_output_tokens == 0
    assert request.output_token_ids == []
    request.append_output_token(8, MAX_MODEL_LEN)
    request.append_output_token(9, MAX_MODEL_LEN)
    assert request.prompt_token_ids == [5, 6, 7]
    assert request.output_token_ids == [8, 9]
    assert request.all_token_ids == [5, 6, 7, 8, 9]
    assert request.num_tokens == 5
    assert request.num_output_tokens == 2
    assert request.num_computed_tokens == 0
    assert request.num_cached_tokens == -1
    assert request.num_preemptions == 0


# -- stop rules -----------------------------------------------------------------------------------

EOS = 2


def append_all(
    request: Request, tokens: list[int], max_model_len: int = MAX_MODEL_LEN
) -> list[RequestStatus | None]:
    """The status each appended token returns."""
    return [request.append_output_token(token, max_model_len) for token in tokens]


def test_eos_stops_without_a_stop_reason() -> None:
    request = make_request(eos_token_ids=(EOS,))
    assert append_all(request, [7, EOS]) == [None, S.FINISHED_STOPPED]
    assert request.stop_reason is None
    assert request.status is S.WAITING  # the scheduler sets the status, not the request


def test_a_stop_token_id_is_the_stop_reason() -> None:
    request = make_request(eos_token_ids=(EOS,), params=SamplingParams(stop_token_ids=[42]))
    assert append_all(request, [7, 42]) == [None, S.FINISHED_STOPPED]
    assert request.stop_reason == 42


def test_stop_tokens_wait_for_min_tokens_and_ignore_eos_drops_eos() -> None:
    request = make_request(eos_token_ids=(EOS,), params=SamplingParams(min_tokens=2))
    assert append_all(request, [EOS, EOS, EOS]) == [None, None, S.FINISHED_STOPPED]
    request = make_request(eos_token_ids=(EOS,), params=SamplingParams(ignore_eos=True))
    assert append_all(request, [EOS, EOS]) == [None, None]


def test_length_caps_max_tokens_and_max_model_len() -> None:
    request = make_request(params=SamplingParams(max_tokens=2))
    assert append_all(request, [7, 8]) == [None, S.FINISHED_LENGTH_CAPPED]
    request = make_request(prompt=list(range(10)), params=SamplingParams(max_tokens=100))
    assert append_all(request, [7, 8], max_model_len=12) == [None, S.FINISHED_LENGTH_CAPPED]


def test_a_stop_token_wins_over_the_length_cap_on_the_same_token() -> None:
    request = make_request(eos_token_ids=(EOS,), params=SamplingParams(max_tokens=2))
    assert append_all(request, [7, EOS]) == [None, S.FINISHED_STOPPED]


def test_prompt_is_copied() -> None:
    prompt = [1, 2, 3]
    request = make_request(prompt=prompt)
    request.append_output_token(4, MAX_MODEL_LEN)
    assert prompt == [1, 2, 3]


def test_max_tokens_override_and_unlimited() -> None:
    assert make_request(params=SamplingParams(max_tokens=7)).max_tokens == 7
    assert make_request(params=SamplingParams(max_tokens=7), request_max_tokens=3).max_tokens == 3
    assert make_request(params=SamplingParams(max_tokens=None)).max_tokens == 1 << 62
    assert make_request(params=SamplingParams(min_tokens=4)).min_tokens == 4


def test_stop_token_sets() -> None:
    request = make_request(params=SamplingParams(stop_token_ids=[42, 43]), eos_token_ids=(2, 3))
    assert request.eos_token_ids == frozenset({2, 3})
    assert request.stop_token_ids == frozenset({2, 3, 42, 43})


def test_ignore_eos_drops_eos_but_keeps_stop_token_ids() -> None:
    params = SamplingParams(stop_token_ids=[42], ignore_eos=True)
    request = make_request(params=params, eos_token_ids=(2,))
    assert request.eos_token_ids == frozenset()
    assert request.stop_token_ids == frozenset({42})


def test_priority_order() -> None:
    a = make_request(request_id="a", priority=1, arrival_time=1.0)
    b = make_request(request_id="b", priority=0, arrival_time=2.0)
    c = make_request(request_id="c", priority=0, arrival_time=3.0)
    d = make_request(request_id="d", priority=0, arrival_time=3.0)
    assert [r.request_id for r in sorted([a, d, c, b])] == ["b", "c", "d", "a"]
    assert b < a and not a < b
    assert c < d and not d < c


# -- block keys -----------------------------------------------------------------------------------


def test_only_full_blocks_are_keyed() -> None:
    assert len(make_request(prompt=list(range(15))).block_keys) == 0
    assert len(make_request(prompt=list(range(16))).block_keys) == 1
    assert len(make_request(prompt=list(range(55))).block_keys) == 3


def test_key_layout_parent_digest_tokens_and_salt() -> None:
    prompt = list(range(40))
    keys = make_request(prompt=prompt, cache_salt="s1").block_keys
    assert len(keys) == 2
    salt = extra_key_bytes("s1")
    assert salt == b"\x00salt\x00s1"
    # parent digest (16 bytes) + 16 tokens as uint32 + the salt on the first block only.
    assert len(keys[0]) == 16 + 16 * 4 + len(salt)
    assert keys[0].startswith(NONE_HASH)
    assert keys[0].endswith(salt)
    assert len(keys[1]) == 16 + 16 * 4
    assert salt not in keys[1]
    unsalted = make_request(prompt=prompt).block_keys
    # Block 1 holds the same tokens but a different parent, so the salt reaches it too.
    assert keys[0][16 : -len(salt)] == unsalted[0][16:]
    assert keys[1][16:] == unsalted[1][16:]
    assert keys[1][:16] != unsalted[1][:16]


def test_chained_keys_fingerprint_the_prefix() -> None:
    a = make_request(prompt=[1] * 16 + [2] * 16).block_keys
    b = make_request(prompt=[9] * 16 + [2] * 16).block_keys
    assert a[0] != b[0]
    assert a[1][16:] == b[1][16:]  # same tokens in block 1 ...
    assert a[1] != b[1]  # ... but a different prefix


def test_keys_grow_as_output_tokens_fill_blocks() -> None:
    prompt = list(range(100, 130))
    request = make_request(prompt=prompt, cache_salt="x")
    assert len(request.block_keys) == 1
    outputs = list(range(500, 540))
    for n, token in enumerate(outputs, start=1):
        request.append_output_token(token, MAX_MODEL_LEN)
        assert len(request.block_keys) == (30 + n) // BLOCK_SIZE
    reference = make_request(prompt=prompt + outputs, cache_salt="x").block_keys
    assert request.block_keys == reference
    assert len(reference) == 4


def test_block_keys_incremental_matches_whole() -> None:
    tokens = list(range(70))
    whole = block_keys(tokens, BLOCK_SIZE, 0, None)
    assert len(whole) == 4
    head = block_keys(tokens[:40], BLOCK_SIZE, 0, None)
    tail = block_keys(tokens, BLOCK_SIZE, len(head), head[-1])
    assert head + tail == whole
    assert block_keys(tokens, BLOCK_SIZE, 4, whole[-1]) == []


def test_no_keys_without_hashing() -> None:
    request = make_request(prompt=list(range(40)), hash_blocks=False)
    assert request.block_keys == []
    for token in range(30):
        request.append_output_token(token, MAX_MODEL_LEN)
    assert request.block_keys == []


def test_samples_in_flight_is_computing_up_to_the_newest_placeholder() -> None:
    request = make_request(prompt=list(range(5)))
    assert not request.samples_in_flight  # no placeholder: nothing in flight
    request.num_output_placeholders = 1
    request.num_computed_tokens = 5  # its last prompt token computed: it samples token 6
    assert request.samples_in_flight
    request.num_computed_tokens = 4  # a chunk short of the end samples nothing
    assert not request.samples_in_flight
    request.num_output_placeholders = 2
    request.num_computed_tokens = 6  # the first placeholder computed: it samples the second
    assert request.samples_in_flight
    request.num_computed_tokens = 5
    assert not request.samples_in_flight
