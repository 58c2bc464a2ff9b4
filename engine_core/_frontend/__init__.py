"""The front end: LLM and AsyncLLM, output processing, per-request collectors and the
detokenizer."""
