"""The n-gram proposer's former home: :mod:`engine_core.ngram` holds it now. This module stays
for one release so that ``from engine_core.spec import NgramProposer`` keeps working."""

from __future__ import annotations

from engine_core.ngram import NgramIndex, NgramProposer

__all__ = ["NgramIndex", "NgramProposer"]
