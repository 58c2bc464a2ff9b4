"""Sliding-window, chunked-local, soft-capped and sink attention: the Triton kernel
(interpreted, with and without split-KV), the per-sequence torch reference and the batched torch
attention against a dense masked attention written out position by position, over paged caches
whose blocks behind each window are released (their table entries -1 or a block of NaNs, so a
read of one shows in the output)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from engine_core_cuda.kernels.paged_attention import paged_attention
from engine_core_cuda.kernels.reference import paged_attention_reference
from engine_core_cuda.kernels.torch_attention import paged_attention_torch


@dataclass
class Kind:
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def options(self, num_heads: int, gen: torch.Generator) -> dict[str, object]:
        sinks = torch.randn(num_heads, generator=gen) * 2 if self.sinks else None
        return {"window": self.window, "chunk": self.chunk, "softcap": self.softcap,
                "sinks": sinks}  # fmt: skip


def _sees(query: int, key: int, kind: Kind) -> bool:
    """Hugging Face's masks: causal, ``key > query - window``, same chunk."""
    if key > query:
        return False
    if kind.window is not None and key <= query - kind.window:
        return False
    return kind.chunk is None or key // kind.chunk == query // kind.chunk


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_query: int, kind: Kind,
    options: dict[str, object], scale: float,
) -> torch.Tensor:  # fmt: skip
    """One sequence: ``q`` ``[Q, heads, D]`` at positions ``first_query ..``, ``k``/``v``
    ``[L, kv_heads, D]`` at positions ``0 ..``."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    sinks = options["sinks"]
    for i in range(q.shape[0]):
        position = first_query + i
        keys = [j for j in range(k.shape[0]) if _sees(position, j, kind)]
        for h in range(q.shape[1]):
            scores = [float(q[i, h].double() @ k[j, h]) * scale for j in keys]
            if kind.softcap is not None:
                scores = [kind.softcap * math.tanh(s / kind.softcap) for s in scores]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            if isinstance(sinks, torch.Tensor):
                total += math.exp(float(sinks[h]) - top)
            for w, j in zip(weights, keys, strict=True):
                out[i, h] += w / total * v[j, h]
    return out.float()


@dataclass
class Case:
    args: tuple[torch.Tensor, ...]
    expected: torch.Tensor
    options: dict[str, object]
    scale: float
    max_query_len: int
    num_released: int


def make_case(q_lens: list[int], context: list[int], kind: Kind, *, num_heads: int = 4,
              num_kv_heads: int = 2, head_size: int = 16, block_size: int = 4,
              seed: int = 0) -> Case:  # fmt: skip
    """Dense keys and values paged into shuffled blocks; the blocks wholly before the first key
    a sequence's first query sees are released: their table entries alternate between -1 and
    the id of a block of NaNs. A windowed layer's entries past a sequence's blocks are the NaN
    block too (it reads only its own); a full layer's are other requests' (finite) blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context, q_lens, strict=True)]
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    poison = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    key_cache[poison] = float("nan")
    value_cache[poison] = float("nan")
    width = max(per_seq) + 1
    windowed = kind.window is not None or kind.chunk is not None
    spare = poison if windowed else int(perm[-1])
    table = torch.full((len(q_lens) + 2, width), spare, dtype=torch.int32)
    rows = torch.randperm(len(q_lens) + 2, generator=gen)[: len(q_lens)].to(torch.int32)
    options = kind.options(num_heads, gen)
    scale = head_size**-0.5
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=gen)
    expected = []
    used = released = start = 0
    for row, n, q_len, blocks in zip(rows.tolist(), seq_lens, q_lens, per_seq, strict=True):
        ids = perm[used : used + blocks].to(torch.int32)
        used += blocks
        table[row, :blocks] = ids
        keys = key_cache[ids.long()].reshape(-1, num_kv_heads, head_size)[:n].clone()
        values = value_cache[ids.long()].reshape(-1, num_kv_heads, head_size)[:n].clone()
        first_query = n - q_len
        first_key = min(j for j in range(n) if _sees(first_query, j, kind))
        for b in range(first_key // block_size):
            table[row, b] = -1 if b % 2 else poison
            released += 1
        expected.append(dense_attention(q[start : start + q_len], keys, values, first_query,
                                        kind, options, scale))  # fmt: skip
        start += q_len
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, key_cache, value_cache, table, rows, qsl, torch.tensor(seq_lens, dtype=torch.int32))
    return Case(args, torch.cat(expected), options, scale, max(q_lens), released)


def _check_all(case: Case, segments: tuple[int, ...] = (1, 4), tile_size: int = 16) -> None:
    got = {
        "reference": paged_attention_reference(*case.args, scale=case.scale, **case.options),
        "torch": paged_attention_torch(*case.args, scale=case.scale, **case.options),
    }
    for num_segments in segments:
        got[f"triton/{num_segments}"] = paged_attention(
            *case.args, scale=case.scale, max_query_len=case.max_query_len,
            num_segments=num_segments, tile_size=tile_size, **case.options,
        )  # fmt: skip
    for name, value in got.items():
        torch.testing.assert_close(value, case.expected, atol=2e-5, rtol=2e-5, msg=name)


# Decodes and prefill chunks whose context runs past the window, a chunk that crosses the window
# edge, sequences shorter than the window, and a query block spanning several window starts.
Q_LENS = [1, 1, 9, 1, 14, 3]
CONTEXT = [30, 3, 21, 12, 0, 40]


@pytest.mark.parametrize(
    "kind",
    [
        Kind(window=8),
        Kind(window=1),
        Kind(chunk=8),
        Kind(chunk=5),
        Kind(softcap=2.0),
        Kind(sinks=True),
        Kind(window=6, softcap=3.0, sinks=True),
    ],
    ids=lambda k: "-".join(f"{f}{v}" for f, v in vars(k).items() if v) or "full",
)
def test_layer_kinds_equal_a_dense_masked_attention(kind: Kind) -> None:
    case = make_case(Q_LENS, CONTEXT, kind, seed=1)
    if kind.window is not None or kind.chunk is not None:
        assert case.num_released > 0  # reading any released entry would give NaNs or fail
    _check_all(case)


def test_full_attention_is_unchanged_by_the_new_arguments() -> None:
    case = make_case(Q_LENS, CONTEXT, Kind(), seed=2)
    _check_all(case, segments=(1, 2))


def test_sinks_dominate_when_large() -> None:
    """A sink far above every score takes the whole softmax: the output goes to zero."""
    case = make_case([1, 5], [7, 2], Kind(), seed=3)
    case.options["sinks"] = torch.full((4,), 60.0)
    got = paged_attention(*case.args, scale=case.scale, max_query_len=5, num_segments=2,
                          sinks=case.options["sinks"])  # fmt: skip
    assert float(got.abs().max()) < 1e-12
    assert float(case.expected.abs().max()) > 0.1  # without the sink it is not zero


@pytest.mark.parametrize("seed", range(4))
def test_random_windows_and_chunks(seed: int) -> None:
    rng = random.Random(200 + seed)
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 4])
    block_size = rng.choice([4, 5, 8])
    num_seqs = rng.randint(1, 4)
    q_lens = [rng.choice([1, rng.randint(2, 20)]) for _ in range(num_seqs)]
    context = [rng.choice([0, rng.randint(0, 50)]) for _ in range(num_seqs)]
    kind = rng.choice([Kind(window=rng.randint(1, 24)), Kind(chunk=rng.randint(2, 16))])
    kind.sinks = rng.random() < 0.5
    case = make_case(q_lens, context, kind, num_heads=num_kv_heads * group,
                     num_kv_heads=num_kv_heads, block_size=block_size, seed=seed)  # fmt: skip
    _check_all(case, segments=(rng.choice([1, 2, 8]),), tile_size=rng.choice([16, 32]))


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"window": 0}, ValueError, "window must be >= 1, got 0"),
        ({"chunk": 2.5}, TypeError, "chunk must be an int or None"),
        ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0"),
        ({"sinks": torch.zeros(3)}, ValueError, r"one logit per query head \(4\)"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks must be a float"),
    ],
)
def test_bad_layer_arguments_are_named(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    case = make_case([1], [3], Kind())
    with pytest.raises(error, match=message):
        paged_attention(*case.args, scale=1.0, max_query_len=1, **options)  # type: ignore[arg-type]
    for fn in (paged_attention_reference, paged_attention_torch):
        with pytest.raises(error, match=message):
            fn(*case.args, scale=1.0, **options)  # type: ignore[arg-type]
