"""KV cache manager: allocation, prefix-cache hits, free order, eviction, salts, statistics.

vLLM's prefix-caching scenarios adapted to a pool without a null block: every one of the
``num_blocks`` blocks is usable and block ids start at 0.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.core import make_request

from engine_core._core.block_pool import KVCacheBlock
from engine_core._core.kv_cache_manager import KVCacheManager
from engine_core._core.request import Request
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16
PREFIX = [0] * 16 + [1] * 16 + [2] * 16  # three full blocks
MAX_MODEL_LEN = 1 << 20


def admit(kv: KVCacheManager, request: Request) -> int:
    """Look up hits, allocate the rest of the prompt and mark it computed, as the scheduler does
    for a request whose whole prompt fits the step. Returns the hit length."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits, full_sequence_must_fit=True)
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_prefill_hits_free_order_and_eviction() -> None:
    """vLLM S1 (test_prefill) with ids starting at 0."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    req0 = make_request("0", PREFIX + [3] * 7)  # 55 tokens
    assert len(req0.block_keys) == 3
    assert kv.get_computed_blocks(req0) == ([], 0)
    assert admit(kv, req0) == 0
    assert req0.block_ids == [0, 1, 2, 3]
    blocks = kv.pool.blocks
    assert [blocks[i].key for i in range(3)] == req0.block_keys
    assert blocks[3].key is None
    assert ref_counts(kv)[:4] == [1, 1, 1, 1]

    req1 = make_request("1", PREFIX + [3] * 5)  # 53 tokens
    hits, num_hit_tokens = kv.get_computed_blocks(req1)
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert num_hit_tokens == 48
    assert admit(kv, req1) == 48
    assert req1.block_ids == [0, 1, 2, 4]
    assert ref_counts(kv)[:5] == [2, 2, 2, 1, 1]
    assert kv.num_free_blocks == 5

    kv.free(req0)
    kv.free(req1)
    assert kv.num_free_blocks == 10
    assert req0.blocks == [] and req1.blocks == []
    # Unkeyed blocks first (most recently freed first), never-used blocks, then the cached
    # prefix least-recently-freed first and tail before head.
    assert kv.pool.free_queue.block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]

    req2 = make_request("2", PREFIX + [3] * 6)
    assert admit(kv, req2) == 48
    assert req2.block_ids == [0, 1, 2, 4]  # reuses the freed partial block
    assert kv.num_free_blocks == 6
    kv.free(req2)
    assert kv.pool.free_queue.block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]

    req3 = make_request("3", [99] * 160)
    assert admit(kv, req3) == 0
    assert req3.block_ids == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]  # the eviction order
    assert kv.num_free_blocks == 0
    for key in req0.block_keys:
        assert kv.pool.lookup(key) is None  # evicted when reused
    assert [kv.pool.lookup(k) for k in req3.block_keys] == req3.blocks


def test_decode_grows_one_block_at_a_time() -> None:
    """vLLM S2 (test_decode)."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    req = make_request("0", PREFIX + [3] * 7)
    admit(kv, req)
    for token in range(4):
        req.append_output_token(100 + token, MAX_MODEL_LEN)
    assert kv.allocate_slots(req, 4)
    req.num_computed_tokens += 4
    assert req.block_ids == [0, 1, 2, 3]  # 59 tokens fit in 4 blocks
    assert req.blocks[3].key is None
    for token in range(19):
        req.append_output_token(200 + token, MAX_MODEL_LEN)
    assert kv.allocate_slots(req, 19)
    req.num_computed_tokens += 19
    assert req.block_ids == [0, 1, 2, 3, 4]
    assert req.blocks[3].key == req.block_keys[3]  # now full, so cached
    assert req.blocks[4].key is None
    assert req.num_cached_blocks == 4


def test_lru_eviction_order() -> None:
    """vLLM S3 (test_evict) with ids starting at 0."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    prompt0 = list(range(87))  # 5 full blocks + 1 partial
    req0 = make_request("0", prompt0)
    req1 = make_request("1", list(range(1000, 1048)))  # 3 full blocks
    admit(kv, req0)
    admit(kv, req1)
    assert req0.block_ids == [0, 1, 2, 3, 4, 5]
    assert req1.block_ids == [6, 7, 8]
    assert kv.num_free_blocks == 1
    kv.free(req0)
    assert kv.pool.free_queue.block_ids() == [5, 9, 4, 3, 2, 1, 0]
    kv.free(req1)
    assert kv.pool.free_queue.block_ids() == [5, 9, 4, 3, 2, 1, 0, 8, 7, 6]
    req2 = make_request("2", prompt0[:35])
    hits, num_hit_tokens = kv.get_computed_blocks(req2)
    assert [b.block_id for b in hits] == [0, 1]
    assert num_hit_tokens == 32
    admit(kv, req2)
    assert req2.block_ids == [0, 1, 5]
    assert kv.num_free_blocks == 7


def test_cache_hit_is_not_evicted_by_the_same_allocation() -> None:
    """vLLM S4 with 2 blocks (no null block): the hit block is at the front of the free queue,
    yet the new allocation takes the other block."""
    kv = KVCacheManager(2, BLOCK_SIZE)
    a = list(range(16))
    b = list(range(100, 116))
    req0 = make_request("0", a)
    req1 = make_request("1", b)
    admit(kv, req0)
    admit(kv, req1)
    assert (req0.block_ids, req1.block_ids) == ([0], [1])
    kv.free(req0)
    kv.free(req1)
    assert kv.pool.free_queue.block_ids() == [0, 1]
    req2 = make_request("2", a + b)
    assert admit(kv, req2) == 16
    assert req2.block_ids == [0, 1]
    assert kv.pool.lookup(req1.block_keys[0]) is None  # block 1's old prefix was evicted
    assert kv.pool.lookup(req0.block_keys[0]) is kv.pool.blocks[0]
    assert kv.pool.lookup(req2.block_keys[1]) is kv.pool.blocks[1]
    assert ref_counts(kv) == [1, 1]


def test_failed_allocation_changes_nothing() -> None:
    """vLLM S5: a 6-block hit (3 held, 3 free) needing 4 more blocks with 3 left fails cleanly."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    prompt_a = list(range(96))
    req_a = make_request("a", prompt_a)
    admit(kv, req_a)
    kv.free(req_a)
    req_b = make_request("b", prompt_a[:48] + list(range(500, 516)))
    assert admit(kv, req_b) == 48
    assert req_b.block_ids == [0, 1, 2, 6]
    refs_before = ref_counts(kv)
    queue_before = kv.pool.free_queue.block_ids()
    assert refs_before[:6] == [1, 1, 1, 0, 0, 0]
    assert kv.num_free_blocks == 6

    req_c = make_request("c", prompt_a + list(range(700, 764)))  # 160 tokens = 10 blocks
    hits, num_hit_tokens = kv.get_computed_blocks(req_c)
    assert [b.block_id for b in hits] == [0, 1, 2, 3, 4, 5]
    assert num_hit_tokens == 96
    # Touching the 3 free hits leaves 3 free blocks for the 4 new ones: no.
    assert not kv.allocate_slots(req_c, 64, hits)
    assert ref_counts(kv) == refs_before
    assert kv.pool.free_queue.block_ids() == queue_before
    assert kv.num_free_blocks == 6
    assert req_c.blocks == []
    assert req_c.num_cached_blocks == 0


def test_full_sequence_must_fit() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE)
    holder = make_request("holder", list(range(32)))
    admit(kv, holder)
    assert kv.num_free_blocks == 2
    req = make_request("0", list(range(100, 148)))  # 3 blocks
    # The first chunk alone would fit, the whole prompt would not.
    assert not kv.allocate_slots(req, 16, full_sequence_must_fit=True)
    assert req.blocks == []
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots(req, 16)
    assert req.block_ids == [2]
    kv.free(req)
    kv.free(holder)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.allocate_slots(req, 16, full_sequence_must_fit=True)
    assert req.block_ids == [3]
    assert kv.num_free_blocks == 3


def test_last_prompt_token_is_always_recomputed() -> None:
    """vLLM S10: a fully cached 32-token prompt hits 16 tokens, a 33-token one 32."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    prompt = list(range(32))
    first = make_request("0", prompt)
    admit(kv, first)
    assert first.num_cached_blocks == 2
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("1", prompt))
    assert (len(hits), num_hit_tokens) == (1, 16)
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("2", prompt + [7]))
    assert (len(hits), num_hit_tokens) == (2, 32)
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("3", prompt[:16]))
    assert (len(hits), num_hit_tokens) == (0, 0)


def test_hits_stop_at_the_first_miss() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE)
    admit(kv, make_request("0", PREFIX + [3] * 16 + [4]))
    changed = PREFIX[:16] + [9] * 16 + PREFIX[32:] + [3] * 16 + [4]
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("1", changed))
    assert ([b.block_id for b in hits], num_hit_tokens) == ([0], 16)


def test_cache_salt_on_the_first_block() -> None:
    """vLLM S7: same tokens and salt hit; another salt or none misses."""
    kv = KVCacheManager(20, BLOCK_SIZE)
    prompt = PREFIX + list(range(11))
    salted = make_request("0", prompt, cache_salt="salt1")
    admit(kv, salted)
    assert kv.get_computed_blocks(make_request("1", prompt, cache_salt="salt1"))[1] == 48
    assert kv.get_computed_blocks(make_request("2", prompt, cache_salt="salt2"))[1] == 0
    assert kv.get_computed_blocks(make_request("3", prompt))[1] == 0
    admit(kv, make_request("4", prompt))
    assert kv.get_computed_blocks(make_request("5", prompt))[1] == 48
    assert kv.get_computed_blocks(make_request("6", prompt, cache_salt="salt2"))[1] == 0


def test_prompt_logprobs_requests_read_no_cached_prefix() -> None:
    """Cached positions are not computed, so they would have no prompt logprobs."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    prompt = PREFIX + [5]

    def wants_logprobs(request_id: str) -> Request:
        params = SamplingParams(prompt_logprobs=0)
        return Request(request_id, prompt, params, block_size=BLOCK_SIZE)

    first = wants_logprobs("0")
    assert admit(kv, first) == 0
    # Its full blocks are cached for others all the same ...
    assert kv.get_computed_blocks(make_request("1", prompt))[1] == 48
    # ... but not read by a request that wants prompt logprobs.
    assert kv.get_computed_blocks(wants_logprobs("2")) == ([], 0)


def test_prefix_caching_disabled() -> None:
    """vLLM S6 with 16-token blocks: no hits, nothing cached, the pool still bounds allocation."""
    kv = KVCacheManager(4, BLOCK_SIZE, enable_caching=False)
    prompt = list(range(40))
    req0 = make_request("0", prompt)
    assert admit(kv, req0) == 0
    assert req0.block_ids == [0, 1, 2]
    kv.free(req0)
    req1 = make_request("1", prompt + list(range(100, 124)))  # 64 tokens
    assert kv.get_computed_blocks(req1) == ([], 0)
    assert admit(kv, req1) == 0
    assert len(req1.blocks) == 4
    assert kv.pool.cached == {}
    assert all(b.key is None for b in kv.pool.blocks)
    assert not kv.allocate_slots(make_request("2", list(range(16))), 16)


def test_reset_prefix_cache() -> None:
    """vLLM S9 (manager level)."""
    kv = KVCacheManager(10, BLOCK_SIZE)
    prompt = PREFIX + [5]
    req = make_request("0", prompt)
    admit(kv, req)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(make_request("1", prompt))[1] == 48
    kv.free(req)
    assert kv.get_computed_blocks(make_request("2", prompt))[1] == 48
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {}
    assert all(b.key is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("3", prompt)) == ([], 0)
    assert kv.num_free_blocks == 10


def test_hit_statistics() -> None:
    kv = KVCacheManager(10, BLOCK_SIZE)
    assert (kv.stats.requests, kv.stats.queries, kv.stats.hits, kv.stats.hit_rate) == (0, 0, 0, 0.0)
    req0 = make_request("0", PREFIX + [1, 2])
    kv.record_admission(req0, admit(kv, req0))
    req1 = make_request("1", PREFIX + [3, 4, 5, 6, 7, 8])
    kv.record_admission(req1, admit(kv, req1))
    # A lookup alone records nothing.
    kv.get_computed_blocks(make_request("2", PREFIX + [9]))
    assert kv.stats.requests == 2
    assert kv.stats.queries == 50 + 54
    assert kv.stats.hits == 48
    assert kv.stats.hit_rate == 48 / 104
    req3 = make_request("3", PREFIX + [5])
    kv.record_admission(req3, admit(kv, req3))
    assert (kv.stats.requests, kv.stats.queries, kv.stats.hits) == (3, 50 + 54 + 49, 96)


def test_usage() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    assert kv.usage == 0.0
    req = make_request("0", list(range(40)))
    admit(kv, req)
    assert kv.usage == 3 / 8
    assert kv.num_blocks == 8
    kv.free(req)
    assert kv.usage == 0.0


_KEYS_SCRIPT = """
from engine_core._core.request import Request
from engine_core.sampling_params import SamplingParams
r = Request("x", list(range(1000, 1100)), SamplingParams(), block_size=16, cache_salt="salt")
print(",".join(k.hex() for k in r.block_keys))
"""


def _keys_in_subprocess(hash_seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    result = subprocess.run(
        [sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip().split(",")


def test_block_keys_are_identical_across_processes() -> None:
    here = make_request("x", list(range(1000, 1100)), cache_salt="salt").block_keys
    assert len(here) == 6
    assert _keys_in_subprocess("1") == [k.hex() for k in here]
    assert _keys_in_subprocess("12345") == [k.hex() for k in here]


def test_hits_alone_need_no_new_block() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE)
    admit(kv, make_request("holder", PREFIX[:32] + [5]))
    req = make_request("0", PREFIX[:32] + [6])
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert num_hit_tokens == 32
    # The hits, and no token beyond them yet.
    assert kv.allocate_slots(req, 0, hits)
    assert req.blocks == hits
    assert [b.ref_cnt for b in hits] == [2, 2]
    assert kv.num_free_blocks == 1


def test_full_sequence_must_fit_counts_the_blocks_held() -> None:
    for num_blocks, fits in [(3, True), (2, False)]:
        kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        req = make_request("0", list(range(100, 140)))  # 40 tokens: 3 blocks
        assert kv.allocate_slots(req, 16)
        req.num_computed_tokens = 16
        # No new block for no new token, but the whole sequence needs two more.
        assert kv.allocate_slots(req, 0, full_sequence_must_fit=True) is fits
        assert len(req.blocks) == 1


def test_each_step_registers_only_the_blocks_that_became_full() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    registered: list[int] = []
    cache_block = kv.pool.cache_block

    def spy(block: KVCacheBlock, key: bytes) -> None:
        registered.append(block.block_id)
        cache_block(block, key)

    kv.pool.cache_block = spy  # type: ignore[method-assign]
    # "dup" fills its first block with a prefix "first" already registered: it keeps no key.
    first = make_request("first", PREFIX[:16] + [7])
    dup = make_request("dup", PREFIX + [8])
    assert kv.allocate_slots(first, 17)
    assert kv.allocate_slots(dup, 20)
    assert registered == [0, 2]
    assert kv.pool.blocks[2].key is None
    dup.num_computed_tokens = 20
    assert kv.allocate_slots(dup, 28)
    assert registered == [0, 2, 3, 4]


def test_uncache_uncomputed_lets_the_blocks_register_again() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    req = make_request("0", PREFIX + [9])
    assert kv.allocate_slots(req, 49)
    assert req.num_cached_blocks == 3
    kv.uncache_uncomputed(req, 20)  # only block 0 was computed
    assert req.num_cached_blocks == 1
    assert [b.key is not None for b in req.blocks] == [True, False, False, False]
    assert kv.pool.lookup(req.block_keys[1]) is None
    req.num_computed_tokens = 20
    assert kv.allocate_slots(req, 29)
    assert req.num_cached_blocks == 3
    assert [kv.pool.lookup(key) for key in req.block_keys] == req.blocks[:3]


def test_a_freed_request_registers_its_blocks_again_from_the_first() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE)
    req = make_request("0", PREFIX + [9])
    assert kv.allocate_slots(req, 49)
    kv.free(req)
    assert req.num_cached_blocks == 0
    assert kv.reset_prefix_cache()
    assert kv.allocate_slots(req, 49)
    assert [kv.pool.lookup(key) for key in req.block_keys] == req.blocks[:3]
