"""A tiny byte-level BPE tokenizer trained offline, for tests that need an HF tokenizer."""

from __future__ import annotations

from pathlib import Path


def save_tiny_bpe(path: Path, corpus: list[str], special_tokens: list[str]) -> Path:
    """Train a 300-token byte-level BPE on ``corpus`` (``special_tokens`` get the first ids) and
    save it as ``path/tokenizer.json``; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path
