"""Text-state LRU cache: keys, byte bound, eviction order, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch

from encoder_svc.cache import CacheKey, TextStateCache
from stagekit.errors import FailedPrecondition


def _t(n_bytes: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n_bytes // 4,), fill, dtype=torch.float32)


def test_key_covers_prompt_model_and_dtype():
    k = CacheKey.make("a cat", "m1", torch.bfloat16)
    assert k == CacheKey.make("a cat".encode(), "m1", torch.bfloat16)  # str and its UTF-8 bytes agree
    assert k != CacheKey.make("a cat ", "m1", torch.bfloat16)
    assert k != CacheKey.make("a cat", "m2", torch.bfloat16)
    assert k != CacheKey.make("a cat", "m1", torch.float32)


def test_hit_miss_and_identity():
    c = TextStateCache(1000)
    k = CacheKey.make("p", "m", "bf16")
    assert c.get(k) is None
    t = _t(400)
    assert c.put(k, t)
    assert c.get(k) is t
    s = c.stats()
    assert (s.hits, s.misses, s.entries, s.bytes) == (1, 1, 1, 400)


def test_lru_eviction_by_bytes():
    c = TextStateCache(1000)
    keys = [CacheKey.make(f"p{i}", "m", "f32") for i in range(4)]
    for k in keys[:3]:
        c.put(k, _t(300))
    c.get(keys[0])  # p0 becomes most recent; p1 is now the LRU
    c.put(keys[3], _t(300))  # 1200 > 1000 -> evict p1
    assert keys[1] not in c and all(k in c for k in (keys[0], keys[2], keys[3]))
    assert c.stats().bytes == 900 and c.stats().evictions == 1
    c.put(keys[1], _t(800))  # needs to evict several
    assert keys[1] in c and c.stats().bytes <= 1000 and len(c) == 1


def test_oversize_not_stored_and_zero_disables():
    c = TextStateCache(100)
    assert not c.put(CacheKey.make("p", "m", "f32"), _t(104))
    assert len(c) == 0
    z = TextStateCache(0)
    assert not z.put(CacheKey.make("p", "m", "f32"), _t(4))
    with pytest.raises(FailedPrecondition, match="--cache-mb"):  # a setting of the server's: one line at start-up
        TextStateCache(-1)


def test_replace_same_key_accounts_bytes():
    c = TextStateCache(1000)
    k = CacheKey.make("p", "m", "f32")
    c.put(k, _t(400))
    c.put(k, _t(200, 1.0))
    assert c.stats().bytes == 200 and c.get(k)[0] == 1.0


def test_invalidate_model_and_get_or_compute():
    c = TextStateCache(10_000)
    for m in ("a", "b"):
        for i in range(3):
            c.put(CacheKey.make(str(i), m, "f32"), _t(8))
    assert c.invalidate_model("a") == 3 and len(c) == 3 and c.stats().bytes == 24
    calls = []
    k = CacheKey.make("x", "a", "f32")
    r1 = c.get_or_compute(k, lambda: calls.append(1) or _t(8, 2.0))
    r2 = c.get_or_compute(k, lambda: calls.append(1) or _t(8, 3.0))
    assert r1 is r2 and len(calls) == 1
    c.clear()
    assert len(c) == 0 and c.stats().bytes == 0


def test_thread_safety_keeps_byte_bound():
    c = TextStateCache(64 * 40)
    errors = []

    def worker(w: int):
        try:
            for i in range(300):
                k = CacheKey.make(f"{(w * 7 + i) % 97}", "m", "f32")
                got = c.get(k)
                if got is None:
                    c.put(k, _t(64, float(w)))
                s = c.stats()
                assert s.bytes <= s.max_bytes
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = c.stats()
    assert s.bytes == 64 * s.entries <= 64 * 40 and s.hits + s.misses == 8 * 300
