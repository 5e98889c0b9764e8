"""Prefix cache: full KV blocks named by a chained hash of the tokens they hold, kept after their
requests end so that a later prompt with the same head reuses them instead of recomputing.

A block's hash covers (its parent block's hash, its token ids); the chain starts from a salt of the
model, KV dtype and block size, so equal hashes mean equal K/V (for one model, dtype, block size).
Only FULL blocks of a prompt are named (a partial one may still be written), and only once
computed.

This class holds the maps (hash <-> block) and the LRU order of cached blocks that no one
references (evictable). It counts no references itself: ``KVPool`` does, under its lock, and tells
it when a cached block's count reaches zero (``park``) or leaves zero (``unpark``). So a block in
use (a running sequence, a lease, a stream) is never in the LRU and never evicted. Not thread-safe:
the pool's lock guards every call.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from prefill_server.errors import InvalidRequest

_DIGEST = 16  # bytes: 2^-64 collision odds at 2^32 blocks (a birthday bound), never a practical risk


def salt_of(model: str, dtype: str, block_size: int) -> bytes:
    """The root of every chain: K/V cached for one model, dtype and block size never serve another."""
    return hashlib.blake2b(f"{model}|{dtype}|{block_size}".encode(), digest_size=_DIGEST).digest()


# vLLM 0.32's rule for a request's ``cache_salt`` (validate_cache_salt): a non-empty string of at most
# 128 characters without these (it names cache entries in vLLM's connectors)
CACHE_SALT_MAX_CHARS, CACHE_SALT_FORBIDDEN = 128, frozenset("@/\\\x00")


def check_client_salt(cache_salt: object) -> str | None:
    """A client's ``cache_salt`` as vLLM takes it (None: none sent), or InvalidRequest naming the fix."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequest("cache_salt must be a non-empty string if given (or leave it out)", field="cache_salt")
    if len(cache_salt) > CACHE_SALT_MAX_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in cache_salt):
        raise InvalidRequest(f"cache_salt must be at most {CACHE_SALT_MAX_CHARS} characters and must not contain "
                             "'@', '/', '\\' or NUL (as vLLM requires): use e.g. a random base64url string",
                             field="cache_salt")
    return cache_salt


def with_client_salt(root: bytes, cache_salt: str | None) -> bytes:
    """The root of a request's chains: ``root`` (the model as run), mixed with the client's
    ``cache_salt`` where it sent one (vLLM's request field), so that its prompt's blocks are shared
    only with requests sending the same salt (a tenant's prompts cannot be probed by another's hits)."""
    if not cache_salt:
        return root
    return hashlib.blake2b(root + b"\x00" + cache_salt.encode("utf-8", "surrogatepass"), digest_size=_DIGEST).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes, limit: int | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (at most ``limit``): the i-th names blocks 0..i."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    raw = array("q", token_ids[: n * block_size]).tobytes()  # 8 bytes a token: any id fits
    step = 8 * block_size
    out, h = [], salt
    for i in range(n):
        h = hashlib.blake2b(h + raw[i * step:(i + 1) * step], digest_size=_DIGEST).digest()
        out.append(h)
    return out


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}  # hash -> block holding that K/V
        self._hash_of: dict[int, bytes] = {}  # its inverse
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.evictions = 0

    @property
    def num_cached(self) -> int:
        """Blocks named in the cache (referenced or not)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def parked(self) -> set[int]:
        return set(self._lru)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of leading hashes that are cached."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, block: int, h: bytes) -> bool:
        """Name a computed, referenced block. False (nothing changes) when the hash is already
        cached in another block (two prompts computed the same head at once: the first one
        stays, the second block is an ordinary one) or the block is named already."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def park(self, block: int) -> None:
        """A cached block's last reference ended: evictable, most recently used."""
        assert block in self._hash_of and block not in self._lru, f"block {block} parked twice"
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is referenced again (a hit): no longer evictable."""
        del self._lru[block]

    def evict(self) -> tuple[int, bytes] | None:
        """Forget the least recently used unreferenced block; returns it (now free) and the name it
        had (for a second tier to keep it under), or None."""
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        name = self._hash_of[block]
        self._forget(block)
        self.evictions += 1
        return block, name

    def reset(self) -> list[int]:
        """Forget every name. Returns the unreferenced blocks (now free); referenced ones stay with
        their holders and become ordinary blocks, freed when their last reference ends."""
        free = list(self._lru)
        self._lru.clear()
        self._block_of.clear()
        self._hash_of.clear()
        return free

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
