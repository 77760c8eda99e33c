"""KVCacheManager: prefix hits, allocation (all or nothing), caching computed blocks, freeing."""

from __future__ import annotations

from engine.kv_cache.hashing import hash_full_blocks
from engine.kv_cache.manager import NO_HIT, KVBlocks, KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, tokens) -> Request:
    return Request(request_id, tuple(tokens), SamplingParams(max_tokens=8))


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> KVBlocks:
    """Allocate for the request's next `num_tokens` tokens and mark them computed."""
    blocks = kv.allocate(request, num_tokens)
    assert blocks is not None
    request.num_computed_tokens += num_tokens
    kv.cache_computed(request)
    return blocks


def admit(kv: KVCacheManager, request: Request) -> KVBlocks:
    """What the scheduler does at admission: look up the prefix, allocate, compute the rest."""
    hit = kv.find_prefix(request)
    blocks = kv.allocate(request, request.num_tokens - hit.num_tokens, hit)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed(request)
    return blocks


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert ref_counts(kv) == [0] * kv.num_blocks


def test_allocate_covers_the_new_tokens_with_ascending_block_ids():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(100, 110))  # 10 tokens -> 3 blocks
    assert kv.allocate(request, 10) == KVBlocks((0, 1, 2))
    assert kv.blocks_of("a") == KVBlocks((0, 1, 2))
    assert kv.num_free_blocks == 5
    kv.free("a")
    assert_all_free(kv)


def test_allocate_adds_a_block_only_when_the_last_one_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(100, 106))  # 6 tokens -> blocks 0, 1 (2 slots left)
    compute(kv, request, 6)
    request.output_token_ids.append(7)
    assert compute(kv, request, 1) == KVBlocks(())  # token 7 fits in block 1
    request.output_token_ids.append(8)
    assert compute(kv, request, 1) == KVBlocks(())  # token 8 fills block 1
    request.output_token_ids.append(9)
    assert compute(kv, request, 1) == KVBlocks((2,))  # token 9 needs block 2
    assert kv.blocks_of("a") == KVBlocks((0, 1, 2))
    kv.free("a")
    assert_all_free(kv)


def test_chunked_allocation_grows_the_same_table():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(100, 120))  # 20 tokens
    assert compute(kv, request, 8) == KVBlocks((0, 1))
    assert compute(kv, request, 8) == KVBlocks((2, 3))
    assert compute(kv, request, 4) == KVBlocks((4,))
    assert kv.blocks_of("a") == KVBlocks((0, 1, 2, 3, 4))
    kv.free("a")
    assert_all_free(kv)


def test_find_prefix_on_an_empty_cache_is_no_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    assert kv.find_prefix(make_request("a", range(100, 112))) == NO_HIT


def test_prompt_of_exactly_n_cached_full_blocks_hits_n_minus_one_so_one_token_is_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", range(100, 112))  # 12 tokens = 3 full blocks
    assert admit(kv, first) == KVBlocks((0, 1, 2))
    assert kv.pool.num_cached_blocks == 3
    second = make_request("b", range(100, 112))
    hit = kv.find_prefix(second)
    assert [b.block_id for b in hit.blocks] == [0, 1]
    assert hit.num_tokens == 8
    kv.free("a")
    assert_all_free(kv)


def test_find_prefix_stops_at_the_first_block_that_differs():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    # Block 1 differs, so block 2 cannot match either (chained hashes).
    hit = kv.find_prefix(make_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13]))
    assert [b.block_id for b in hit.blocks] == [0]
    assert hit.num_tokens == 4
    kv.free("a")
    assert_all_free(kv)


def test_find_prefix_takes_no_references():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(100, 109)))
    kv.free("a")
    kv.find_prefix(make_request("b", range(100, 109)))
    assert_all_free(kv)


def test_allocate_with_a_hit_shares_block_ids_with_the_earlier_request():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", range(100, 110))  # 10 tokens: blocks 0, 1 full; 2 partial
    assert admit(kv, first) == KVBlocks((0, 1, 2))
    second = make_request("b", [*range(100, 108), 50, 51, 52])  # shares 2 full blocks
    hit = kv.find_prefix(second)
    assert hit.num_tokens == 8
    assert kv.allocate(second, second.num_tokens - hit.num_tokens, hit) == KVBlocks((0, 1, 3))
    assert kv.blocks_of("b") == KVBlocks((0, 1, 3))
    assert ref_counts(kv) == [2, 2, 1, 1, 0, 0, 0, 0]
    kv.free("a")
    assert ref_counts(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    kv.free("b")
    assert_all_free(kv)


def test_allocate_with_a_hit_on_freed_cached_blocks_takes_them_off_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(100, 109)))  # 9 tokens: blocks 0, 1 cached; 2 partial
    kv.free("a")
    second = make_request("b", range(100, 109))
    hit = kv.find_prefix(second)
    assert kv.allocate(second, 1, hit) == KVBlocks((0, 1, 3))
    assert ref_counts(kv) == [1, 1, 0, 1]
    assert [b.block_id for b in kv.pool.free_queue] == [2]
    kv.free("b")
    assert_all_free(kv)


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(100, 112)), 12)  # blocks 0, 1, 2
    before_queue = [b.block_id for b in kv.pool.free_queue]
    request = make_request("b", range(200, 208))
    assert kv.allocate(request, 8) is None
    assert kv.blocks_of("b") == KVBlocks(())
    assert [b.block_id for b in kv.pool.free_queue] == before_queue == [3]
    assert ref_counts(kv) == [1, 1, 1, 0]
    assert kv.pool.take_events().evicted == ()
    kv.free("a")
    assert_all_free(kv)


def test_allocation_with_a_hit_fails_when_touching_free_hit_blocks_leaves_too_few():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(100, 109)))  # blocks 0, 1 cached; block 2 partial
    kv.free("a")
    # 3 free blocks, but the 2 hit blocks are among them: 13 tokens need 4 blocks in all.
    request = make_request("b", [*range(100, 108), 1, 2, 3, 4, 5])
    hit = kv.find_prefix(request)
    assert hit.num_tokens == 8
    assert kv.allocate(request, 5, hit) is None
    assert ref_counts(kv) == [0, 0, 0]
    assert kv.pool.lookup(hit.blocks[0].block_hash) is hit.blocks[0]
    assert kv.blocks_of("b") == KVBlocks(())
    assert_all_free(kv)


def test_cache_computed_registers_only_fully_computed_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    tokens = list(range(100, 112))
    request = make_request("a", tokens)
    kv.allocate(request, 12)
    request.num_computed_tokens = 7  # block 0 full, block 1 partly computed
    kv.cache_computed(request)
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    assert kv.pool.take_events().stored == (hashes[0],)
    request.num_computed_tokens = 12
    kv.cache_computed(request)
    assert kv.pool.take_events().stored == (hashes[1], hashes[2])
    assert [kv.pool.lookup(h).block_id for h in hashes] == [0, 1, 2]
    kv.free("a")
    assert_all_free(kv)


def test_cache_computed_hashes_output_tokens_too():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(kv, request, 6)
    kv.pool.take_events()
    request.output_token_ids.extend([7, 8])
    compute(kv, request, 1)  # token 7 computed; token 8 just sampled
    assert kv.pool.take_events().stored == ()
    compute(kv, request, 1)  # token 8 computed: block 1 = [5, 6, 7, 8] is full
    assert kv.pool.take_events().stored == (hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)[1],)
    kv.free("a")
    assert_all_free(kv)


def test_free_is_idempotent_and_unknown_ids_are_ignored():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(100, 106)), 6)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.blocks_of("a") == KVBlocks(())
    assert_all_free(kv)


def test_free_releases_last_block_first_so_the_tail_of_a_prefix_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(100, 113)))  # 13 tokens: 0, 1, 2 cached; 3 partial
    kv.free("a")
    assert [b.block_id for b in kv.pool.free_queue] == [3, 2, 1, 0]
    kv.pool.take_events()
    # An unrelated request takes two blocks: the partial block 3 and block 2 (a's third), by id.
    assert compute(kv, make_request("b", range(200, 208)), 8) == KVBlocks((2, 3))
    assert kv.pool.take_events().evicted == (hash_full_blocks(list(range(100, 112)), 4)[2],)
    hit = kv.find_prefix(make_request("c", range(100, 113)))
    assert [b.block_id for b in hit.blocks] == [0, 1]
    kv.free("b")
    assert_all_free(kv)


def test_preempted_request_recomputes_over_its_own_cached_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(100, 110))
    compute(kv, request, 10)
    request.output_token_ids.append(42)
    kv.free("a")  # preempted: blocks freed, computed tokens forgotten
    request.num_computed_tokens = 0
    hit = kv.find_prefix(request)  # 11 tokens: blocks 0 and 1 are still cached
    assert [b.block_id for b in hit.blocks] == [0, 1]
    # The partial block 2 went to the queue's tail; a never-used block comes first.
    assert kv.allocate(request, request.num_tokens - hit.num_tokens, hit) == KVBlocks((0, 1, 3))
    kv.free("a")
    assert_all_free(kv)


def test_manager_without_prefix_caching_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    admit(kv, make_request("a", range(100, 112)))
    assert kv.find_prefix(make_request("b", range(100, 112))) == NO_HIT
    assert kv.pool.num_cached_blocks == 0
    kv.free("a")
    assert_all_free(kv)


def test_num_blocks_for_rounds_up():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_usage_counts_blocks_held_by_requests():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute(kv, make_request("a", range(100, 110)), 10)
    assert kv.usage == 3 / 8
    kv.free("a")
    assert kv.usage == 0.0
    assert_all_free(kv)
