"""How a JSON schema is read before it becomes a grammar: objects that list their properties
are closed unless the schema asks for more keys."""

from __future__ import annotations

from typing import Any

from engine_core._structured.grammar import close_objects

PERSON: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}}}


def test_an_object_listing_its_properties_is_closed() -> None:
    assert close_objects(PERSON) == PERSON | {"additionalProperties": False}
    assert "additionalProperties" not in PERSON  # the caller's schema is not changed


def test_what_the_schema_says_about_other_keys_is_kept() -> None:
    for extra in (
        {"additionalProperties": True},
        {"additionalProperties": {"type": "integer"}},
        {"patternProperties": {"^x-": {}}},
        {"unevaluatedProperties": False},
    ):
        closed = close_objects(PERSON | extra)
        assert closed == PERSON | extra | (
            {"additionalProperties": {"type": "integer"}}
            if extra.get("additionalProperties") == {"type": "integer"}
            else {}
        )


def test_objects_without_properties_and_allof_branches_stay_open() -> None:
    assert close_objects({"type": "object"}) == {"type": "object"}
    both = {"allOf": [PERSON, {"properties": {"age": {"type": "integer"}}}]}
    assert close_objects(both) == both


def test_nested_objects_are_closed_wherever_a_subschema_can_be() -> None:
    closed = close_objects(
        {
            "type": "object",
            "properties": {"owner": PERSON, "pets": {"type": "array", "items": PERSON}},
            "$defs": {"p": PERSON},
            "anyOf": [PERSON, {"type": "null"}],
            "additionalProperties": PERSON,
        }
    )
    strict = PERSON | {"additionalProperties": False}
    assert closed["properties"]["owner"] == strict
    assert closed["properties"]["pets"]["items"] == strict
    assert closed["$defs"]["p"] == strict
    assert closed["anyOf"] == [strict, {"type": "null"}]
    assert closed["additionalProperties"] == strict
    assert "additionalProperties" in closed  # an explicit schema for extras is kept, not closed
