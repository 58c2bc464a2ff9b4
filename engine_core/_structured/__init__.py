"""Structured outputs: grammars compiled with llguidance and the bitmasks they fill."""
