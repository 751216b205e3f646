"""Prefix keys: chaining, stable-prefix cut, secret keying, namespace roots."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from router.placement.prefix import namespace_root, prefix_key, stable_length
from worker.protocol import block_id, block_ids

SECRET = b"deployment-secret"
ROOT = namespace_root("smollm2-135m", "tok-v1", "tenant-a", SECRET)


def key(tokens, stable_len=None, **kw):
    args = {"root": ROOT, "block_size": 16, "max_tokens": 256} | kw
    return prefix_key(tokens, stable_len, **args)


def test_root_depends_on_every_field_and_the_secret() -> None:
    roots = {
        ROOT,
        namespace_root("other-model", "tok-v1", "tenant-a", SECRET),
        namespace_root("smollm2-135m", "tok-v2", "tenant-a", SECRET),
        namespace_root("smollm2-135m", "tok-v1", "tenant-b", SECRET),
        namespace_root("smollm2-135m", "tok-v1", "tenant-a", b"another secret"),
        # length-prefixed fields: moving a character between fields changes the root
        namespace_root("smollm2-135", "mtok-v1", "tenant-a", SECRET),
    }
    assert len(roots) == 6
    assert all(len(r) == 16 for r in roots)
    assert namespace_root("smollm2-135m", "tok-v1", "tenant-a", SECRET) == ROOT


def test_no_key_below_one_block() -> None:
    assert key(list(range(15))) is None
    assert key(list(range(100)), stable_len=15) is None
    assert key(list(range(16))) is not None


def test_key_covers_only_the_block_aligned_stable_prefix() -> None:
    base = list(range(1000, 1040))
    # 40 tokens -> 32 covered; changing token 35 keeps the key, changing token 31 does not
    changed_tail = base[:35] + [7] + base[36:]
    changed_inside = base[:31] + [7] + base[32:]
    assert key(base) == key(changed_tail)
    assert key(base) != key(changed_inside)
    # chat: only tokens before stable_len count, whatever follows (the last user turn)
    assert key(base + [1, 2, 3] * 30, stable_len=40) == key(base + [9] * 50, stable_len=40)
    assert key(base, stable_len=32) == key(base)


def test_completion_prefix_capped_at_route_prefix_tokens() -> None:
    long_a = list(range(600))
    long_b = list(range(256)) + [5] * 344
    assert key(long_a) == key(long_b)
    assert key(long_a, max_tokens=512) != key(long_b, max_tokens=512)
    assert stable_length(600, None, block_size=16, max_tokens=250) == 240


def test_chain_matches_the_definition() -> None:
    tokens = np.arange(48, dtype=np.int64) * 7919
    seed = xxhash.xxh3_64_intdigest(ROOT)  # h_0 = the namespace root, keyed by the deployment secret
    h = ROOT
    for b in range(3):
        block = tokens[16 * b : 16 * (b + 1)].astype("<i4").tobytes()
        h = xxhash.xxh3_128_digest(h + block, seed=seed)
    assert key(tokens) == h
    # list, numpy and packed-bytes inputs agree
    assert key(tokens.tolist()) == h
    assert key(tokens.astype("<i4").tobytes()) == h


def test_secret_and_root_change_the_key() -> None:
    toks = list(range(64))
    assert key(toks) != key(toks, root=namespace_root("smollm2-135m", "tok-v1", "tenant-a", b"x"))
    assert key(toks) != key(toks, root=namespace_root("m", "t", "tenant-b", SECRET))


def test_key_is_the_block_hash_workers_report() -> None:
    toks = list(range(100, 164))
    ids = block_ids(ROOT, toks, 16)
    assert len(ids) == 4 and ids[-1] == block_id(key(toks))
    assert block_ids(ROOT, toks[:32], 16) == ids[:2]  # a chain: a prefix's ids are a prefix of the ids


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        namespace_root("m", "t", "s", b"")
    with pytest.raises(ValueError):
        key(list(range(64)), stable_len=65)
    with pytest.raises(ValueError):
        key(list(range(64)), root=b"short")
    with pytest.raises(ValueError):
        key(list(range(64)), block_size=0)
