"""``helpers.strategies`` covers every ``SamplingParams`` field."""

from __future__ import annotations

from engine_core.sampling_params import SamplingParams
from helpers.strategies import SAMPLING_FIELDS


def test_sampling_fields_name_every_field_but_structured_outputs() -> None:
    fields = [name for name in SamplingParams.__struct_fields__ if name != "structured_outputs"]
    assert list(SAMPLING_FIELDS) == fields
