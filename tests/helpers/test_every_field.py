"""``helpers.every_field`` sets every field of its structs away from its default."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from engine_core._core.engine_io import EngineStats
from helpers.every_field import AT_DEFAULT, KWARGS, instance


def defaults(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field's value in an instance that leaves it at its default, as the struct keeps it
    (``SamplingParams`` keeps a ``stop`` of None as ``[]``); required fields are left out."""
    fields = msgspec.structs.fields(cls)
    if all(not f.required for f in fields):
        return msgspec.structs.asdict(cls())
    return {
        f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
        for f in fields
        if not f.required
    }


@pytest.mark.parametrize("cls", KWARGS, ids=lambda cls: cls.__name__)
def test_every_field_is_away_from_its_default(cls: type[msgspec.Struct]) -> None:
    values = msgspec.structs.asdict(instance(cls))
    at_default = [name for name, default in defaults(cls).items() if values[name] == default]
    assert at_default == sorted(AT_DEFAULT.get(cls, {}), key=list(values).index)


def test_engine_stats_fields_all_differ() -> None:
    values = [repr(v) for v in msgspec.structs.astuple(instance(EngineStats))]
    assert len(set(values)) == len(values)
