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


def save_tiny_byte_fallback(path: Path, corpus: list[str], special_tokens: list[str]) -> Path:
    """A SentencePiece-style tokenizer as Llama 2's ``tokenizer.json`` has it: ``▁`` marks a word
    start, characters outside the vocabulary fall back to ``<0xXX>`` byte pieces, and the
    decoder strips the one leading space of the text. A BPE of about 120 pieces is trained on
    ``corpus``; ``special_tokens`` get the first ids, the 256 byte pieces the next ones."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    trained.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=special_tokens, limit_alphabet=40, show_progress=False
    )
    trained.train_from_iterator(corpus, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate(special_tokens)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in sorted(model["vocab"], key=model["vocab"].__getitem__):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(special_tokens)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path
