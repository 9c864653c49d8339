"""LRU cache of text-conditioning states, bounded by bytes, thread-safe.

Key = (sha256 of the prompt's UTF-8 bytes, model id, dtype): identical prompt + identical weights +
identical output dtype => identical states, so a repeated prompt (retries, seeds sweeps, the same
prompt at several resolutions) skips the 32B forward. Values are returned as stored: treat them as
read-only (the encoder hands them to the wire codec, which only reads).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from stagekit.errors import FailedPrecondition


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class CacheKey:
    prompt_sha256: str
    model_id: str
    dtype: str

    @classmethod
    def make(cls, prompt: str | bytes, model_id: str, dtype: torch.dtype | str) -> "CacheKey":
        data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
        return cls(hashlib.sha256(data).hexdigest(), model_id, str(dtype))


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int


class TextStateCache:
    """``get``/``put`` by :class:`CacheKey`; least-recently-used entries are evicted past ``max_bytes``.

    A single tensor larger than ``max_bytes`` is not stored. ``max_bytes=0`` disables caching.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise FailedPrecondition(f"--cache-mb must be >= 0 (0 disables the cache), got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self._data: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    def get(self, key: CacheKey) -> torch.Tensor | None:
        with self._lock:
            t = self._data.get(key)
            if t is None:
                self._misses += 1
                return None
            self._data.move_to_end(key)
            self._hits += 1
            return t

    def put(self, key: CacheKey, states: torch.Tensor) -> bool:
        """Store ``states`` (a reference, not a copy; detached if it needs grad). Returns whether it was kept."""
        size = _nbytes(states)
        if size > self.max_bytes:
            return False
        if states.requires_grad:
            states = states.detach()
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            self._data[key] = states
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= _nbytes(evicted)
                self._evictions += 1
            return True

    def get_or_compute(self, key: CacheKey, compute) -> torch.Tensor:
        """Cached states, or ``compute()`` stored then returned. ``compute`` runs outside the lock, so two
        threads missing the same key may both compute (the encoder serialises GPU work anyway)."""
        t = self.get(key)
        if t is not None:
            return t
        t = compute()
        self.put(key, t)
        return t

    def invalidate_model(self, model_id: str) -> int:
        """Drop every entry of one model (e.g. on unload/reload of different weights). Returns the count."""
        with self._lock:
            keys = [k for k in self._data if k.model_id == model_id]
            for k in keys:
                self._bytes -= _nbytes(self._data.pop(k))
            return len(keys)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._data

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._data), self._bytes, self.max_bytes, self._hits, self._misses, self._evictions)
