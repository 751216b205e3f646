"""Prefix keys: the namespace root `h_0` (keyed by the deployment secret) and the chained block hash of a
prompt's stable prefix (`worker.protocol.chain`, the definition workers report their blocks under).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

from worker.protocol import chain

DIGEST_SIZE = 16  # xxh3-128
DEFAULT_ROUTE_PREFIX_TOKENS = 256


def _seed(secret: bytes) -> int:
    return xxhash.xxh3_64_intdigest(secret)


def _keyed_hash(secret: bytes, *parts: bytes | memoryview) -> bytes:
    # Seeded with a value derived from the secret and with the secret prepended:
    # the 64-bit seed alone would be brute-forceable, the prefix alone would not
    # change the hash's internal constants.
    h = xxhash.xxh3_128(secret, seed=_seed(secret))
    for part in parts:
        h.update(part)
    return h.digest()


def _field(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return len(raw).to_bytes(4, "little") + raw  # length-prefixed: no ambiguous concatenation


def namespace_root(model_id: str, tokenizer_version: str, tenant_salt: str | bytes, secret: bytes) -> bytes:
    """`h_0`: the cache namespace of (model, tokenizer, tenant) and root of every prefix key."""
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("secret must be non-empty bytes")
    if not model_id:
        raise ValueError("model_id must be non-empty")
    return _keyed_hash(bytes(secret), _field(model_id), _field(tokenizer_version), _field(tenant_salt))


def stable_length(n_tokens: int, stable_len: int | None, *, block_size: int, max_tokens: int) -> int:
    """Block-aligned number of tokens the key covers (0 means: no key).

    `stable_len` is the chat stable prefix (everything before the last user turn);
    None means a raw completion, whose stable prefix is the whole prompt. Both are
    capped at `max_tokens` so that a conversation keeps its key as history grows.
    """
    if block_size <= 0 or max_tokens < 0:
        raise ValueError("block_size must be > 0 and max_tokens >= 0")
    limit = n_tokens if stable_len is None else stable_len
    if limit < 0 or limit > n_tokens:
        raise ValueError(f"stable_len {stable_len} outside 0..{n_tokens}")
    limit = min(limit, max_tokens)
    return limit - limit % block_size


def token_count(tokens: Sequence[int] | np.ndarray | bytes | bytearray | memoryview) -> int:
    """Tokens in a prompt given as ids or as packed little-endian int32 bytes."""
    return len(tokens) // 4 if isinstance(tokens, bytes | bytearray | memoryview) else len(tokens)


def key_span(tokens: Sequence[int] | np.ndarray | bytes, stable_len: int | None, *, block_size: int,
             max_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS) -> int:
    """`stable_length` of a prompt given as ids or packed int32 bytes: the tokens its key covers."""
    return stable_length(token_count(tokens), stable_len, block_size=block_size, max_tokens=max_tokens)


def prefix_key(
    tokens: Sequence[int] | np.ndarray | bytes,
    stable_len: int | None,
    *,
    root: bytes,
    block_size: int,
    max_tokens: int = DEFAULT_ROUTE_PREFIX_TOKENS,
) -> bytes | None:
    """Chained block hash of the stable prefix, or None when it is shorter than one block.

    `tokens` may be a list/array of ids or packed little-endian int32 bytes.
    """
    if len(root) != DIGEST_SIZE:
        raise ValueError(f"root must be a {DIGEST_SIZE}-byte namespace_root digest")
    n = key_span(tokens, stable_len, block_size=block_size, max_tokens=max_tokens)
    if n == 0:
        return None
    return chain(root, root, tokens, block_size, n // block_size)[-1]


def cache_key_route(root: bytes, secret: bytes, cache_key: str) -> bytes:
    """The routing key of a client's `prompt_cache_key`, inside its tenant's namespace `root`."""
    if len(root) != DIGEST_SIZE:
        raise ValueError(f"root must be a {DIGEST_SIZE}-byte namespace_root digest")
    return _keyed_hash(secret, root, b"prompt_cache_key", _field(cache_key))


def fairness_key(tenant_name: str, secret: bytes) -> bytes:
    """The tenant's fairness key on workers: a keyed digest of its name (stable across models and salts)."""
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("secret must be non-empty bytes")
    return hashlib.blake2b(b"fair\0" + tenant_name.encode(), key=bytes(secret)[:64], digest_size=8).digest()


def key_point(key: bytes) -> int:
    """The key's 64-bit position on the hash ring."""
    return int.from_bytes(key[:8], "little")
