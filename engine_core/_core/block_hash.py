"""Prefix-cache keys for full KV blocks.

Block ``i`` of a token sequence is keyed by ``parent digest + the block's token ids as uint32
bytes (+ extra keys on the first block)``; its digest (xxh3-128 of the key) is the parent of block
``i + 1``. So a key fingerprints the whole prefix up to its block, and because the key *contains*
the block's tokens, a dictionary hit on it is verified against the stored tokens by the key
comparison itself: a digest collision cannot produce a wrong hit. Digests are stable across
processes and runs (no salted ``hash()``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from xxhash import xxh3_128_digest

__all__ = ["NONE_HASH", "block_digests", "block_keys", "extra_key_bytes", "iter_block_digests"]

NONE_HASH = xxh3_128_digest(b"engine-core/prefix-cache/v1")
"""Parent digest of the first block of every sequence."""

_TOKEN_BYTES = 4


def extra_key_bytes(cache_salt: str | None, lora_key: bytes = b"") -> bytes:
    """Tagged extra keys of the first block (a tag keeps kinds of keys from colliding): the
    cache salt, then the LoRA adapter's identity (``LoRARequest.key_bytes``; empty: the base
    model)."""
    if cache_salt is None:
        return lora_key
    return b"\x00salt\x00" + cache_salt.encode() + lora_key


def block_keys(
    token_ids: list[int],
    block_size: int,
    start_block: int,
    parent_key: bytes | None,
    first_block_extra: bytes = b"",
) -> list[bytes]:
    """Keys of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids``.

    ``parent_key`` is the key of block ``start_block - 1`` (None for the first block).
    """
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    data = array("I", token_ids[start_block * block_size : num_full * block_size]).tobytes()
    step = block_size * _TOKEN_BYTES
    parent = NONE_HASH if parent_key is None else xxh3_128_digest(parent_key)
    keys = []
    for offset in range(0, len(data), step):
        key = parent + data[offset : offset + step]
        if offset == 0 and start_block == 0 and first_block_extra:
            key += first_block_extra
        keys.append(key)
        parent = xxh3_128_digest(key)
    return keys


def block_digests(
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    cache_salt: str | None = None,
    lora_key: bytes = b"",
) -> list[bytes]:
    """Digests of the first ``num_blocks`` full blocks of ``token_ids`` (at most as many as
    there are): the names the engines' KV events give those blocks (xxh3-128 of each key)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    if num_blocks <= 0:
        return []
    data = array("I", token_ids[: num_blocks * block_size]).tobytes()
    step = block_size * _TOKEN_BYTES
    parent = NONE_HASH
    extra = extra_key_bytes(cache_salt, lora_key)
    digests = []
    for offset in range(0, len(data), step):
        key = parent + data[offset : offset + step]
        if offset == 0 and extra:
            key += extra
        parent = xxh3_128_digest(key)
        digests.append(parent)
    return digests


def iter_block_digests(
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    cache_salt: str | None = None,
    lora_key: bytes = b"",
) -> Iterator[bytes]:
    """:func:`block_digests` one at a time, converting the tokens in growing chunks: a caller
    that stops at the first block nobody caches pays for the blocks it looked at only."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    step = block_size * _TOKEN_BYTES
    parent = NONE_HASH
    extra = extra_key_bytes(cache_salt, lora_key)
    start, chunk = 0, 8
    while start < num_blocks:
        end = min(num_blocks, start + chunk)
        data = array("I", token_ids[start * block_size : end * block_size]).tobytes()
        for offset in range(0, len(data), step):
            key = parent + data[offset : offset + step]
            if start == 0 and offset == 0 and extra:
                key += extra
            parent = xxh3_128_digest(key)
            yield parent
        start, chunk = end, chunk * 2
