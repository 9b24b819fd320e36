"""Paged KV cache bookkeeping: the block pool, the prefix cache and host swap space.

No tensors live here: the executor owns the memory, this module owns which block holds what.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.request import Request


class BlockPool:
    """Fixed set of device blocks with reference counts.

    Free blocks sit in `free` in eviction order (head first). A freed block that holds a
    cached prefix keeps its hash and goes to the tail, so the least recently used cached block
    is reused first; a freed block with nothing worth keeping goes to the head.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # prefix hash -> block
        self.block_hash: list[int | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), f"allocate({n}) with only {len(self.free)} free blocks"
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            if self.block_hash[block] is not None:
                self._uncache(block)
            assert self.ref_counts[block] == 0, f"free block {block} is in use"
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared again,
        # so they reach the eviction end of the free queue first.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released too often"
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: int) -> None:
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None

    def check_invariants(self) -> None:
        for block, count in enumerate(self.ref_counts):
            assert count >= 0
            assert (count == 0) == (block in self.free), f"block {block}: ref {count}, free mismatch"
        for block_hash, block in self.cached.items():
            assert self.block_hash[block] == block_hash


class KVCacheManager:
    """Per-request block tables on top of the pool, the prefix cache and host swap space."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks = list(range(num_host_blocks - 1, -1, -1))
        self.host_tables: dict[str, list[int]] = {}  # swapped request -> its host blocks
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests; cached blocks nobody holds count as free."""
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[int]:
        """Chain hashes of the request's full blocks, extended as tokens arrive. The tenant
        salts the chain's root, so two tenants never share a cache block."""
        hashes = request.block_hashes
        size = self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[i - 1] if i else hash(("fairgate-prefix", request.tenant))
            hashes.append(hash((parent, tuple(request.token_slice(i * size, (i + 1) * size)))))
        return hashes

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding a cached prefix of a request that has computed nothing yet. At least
        one token is always left to compute, because its logits are what the step samples from."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ---- allocation --------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     cached_blocks: list[int] | None = None) -> bool:
        return self._new_blocks_needed(request, num_new_tokens, cached_blocks) <= self._available(
            cached_blocks)

    def shortfall(self, request: Request, num_new_tokens: int,
                  cached_blocks: list[int] | None = None) -> int:
        """Blocks missing for `allocate` to succeed (0 when it would)."""
        needed = self._new_blocks_needed(request, num_new_tokens, cached_blocks)
        return max(0, needed - self._available(cached_blocks))

    def exclusive_blocks(self, requests: Iterable[Request]) -> int:
        """Blocks that freeing these requests would return to the pool (shared prefix blocks
        held by anyone else stay in use)."""
        refs: dict[int, int] = {}
        for request in requests:
            for block in request.block_ids:
                refs[block] = refs.get(block, 0) + 1
        return sum(1 for block, n in refs.items() if self.pool.ref_counts[block] == n)

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more computed tokens, first adopting `cached_blocks`
        (a prefix-cache hit). Returns False, changing nothing, when the blocks do not fit."""
        needed = self._new_blocks_needed(request, num_new_tokens, cached_blocks)
        if needed <= 0 and not cached_blocks:
            return True  # the common decode: room left in the last block
        if needed > self._available(cached_blocks):
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_ids.extend(cached_blocks)
            request.num_computed_tokens = len(cached_blocks) * self.block_size
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    def note_admission(self, request: Request, num_cached_blocks: int) -> None:
        request.num_cached_tokens = num_cached_blocks * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += request.num_cached_tokens

    def forget_admission(self, request: Request) -> None:
        """Take back `note_admission` for a request put back before it ran."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries -= request.num_tokens
            self.prefix_cache_hits -= request.num_cached_tokens
        request.num_cached_tokens = 0

    def _new_blocks_needed(self, request: Request, num_new_tokens: int,
                           cached_blocks: list[int] | None) -> int:
        num_cached = len(cached_blocks) if cached_blocks else 0
        computed = request.num_computed_tokens + num_cached * self.block_size
        return self.blocks_needed(computed + num_new_tokens) - len(request.block_ids) - num_cached

    def _available(self, cached_blocks: list[int] | None) -> int:
        if not cached_blocks:
            return self.pool.num_free
        # Adopting a free cached block takes it off the free queue.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        return self.pool.num_free - revived

    def commit(self, request: Request) -> None:
        """Publish newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_committed_blocks:
            return
        hashes = self.block_hashes(request)
        for i in range(request.num_committed_blocks, min(num_full, len(request.block_ids))):
            self.pool.cache(request.block_ids[i], hashes[i])
        request.num_committed_blocks = num_full

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_committed_blocks = 0
        host = self.host_tables.pop(request.request_id, None)
        if host:
            self.free_host_blocks.extend(host)

    def trim(self, request: Request) -> None:
        """Release blocks beyond those holding computed tokens (allocated for a step that
        did not run)."""
        keep = self.blocks_needed(request.num_computed_tokens)
        extra = request.block_ids[keep:]
        if extra:
            self.pool.release(extra)
            del request.block_ids[keep:]

    # ---- swap ----------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a request's blocks to host memory: (device, host) copies for the executor, or
        None when host space is short (the caller falls back to recompute)."""
        self.trim(request)
        if len(request.block_ids) > len(self.free_host_blocks):
            return None
        host = [self.free_host_blocks.pop() for _ in request.block_ids]
        mapping = list(zip(request.block_ids, host, strict=True))
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_committed_blocks = 0
        self.host_tables[request.request_id] = host
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        host = self.host_tables.pop(request.request_id)
        device = self.pool.allocate(len(host))
        request.block_ids = device
        self.free_host_blocks.extend(host)
        return list(zip(host, device, strict=True))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = sum(len(h) for h in self.host_tables.values())
        assert held + len(self.free_host_blocks) == self.num_host_blocks
