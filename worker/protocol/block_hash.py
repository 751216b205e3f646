"""The one definition of KV block hashes, shared by the gateway (routing keys, index look-ups) and the worker
(reports of the blocks its radix cache stores and evicts). Re-exported by `worker.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# Named in the worker's kv handshake; change it whenever `chain` changes, so that mixed versions refuse each
# other.
HASH_ALGO = "xxh3-128/ns-chain/1"
DIGEST_SIZE = 16
_TOKEN_DTYPE = np.dtype("<i4")


def ns_seed(ns: bytes) -> int:
    """The xxh3 seed of a namespace's chain: `ns` is `h_0`, itself a digest keyed by the deployment secret."""
    return xxhash.xxh3_64_intdigest(ns)


def block_bytes(tokens: Sequence[int] | np.ndarray | bytes | memoryview, n: int) -> memoryview:
    """The first `n` token ids as packed little-endian int32 bytes (the bytes every hash covers)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        raw = memoryview(tokens).cast("B")
        if len(raw) < 4 * n:
            raise ValueError("token bytes shorter than the requested prefix")
        return raw[: 4 * n]
    arr = np.asarray(tokens[:n])
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    return memoryview(np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)).cast("B")


def chain(ns: bytes, parent: bytes, tokens: Sequence[int] | np.ndarray | bytes | memoryview, block_size: int,
          n_blocks: int | None = None) -> list[bytes]:
    """`h_i = xxh3_128(h_{i-1} ‖ tokens_i, seed=ns_seed(ns))` for the whole blocks of `tokens` after `parent`.

    `parent` is `ns` itself (h_0) at the start of a prompt, else the digest of the block before `tokens`.
    Returns one 16-byte digest per whole block (at most `n_blocks`).
    """
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    count = (len(tokens) // 4 if isinstance(tokens, bytes | bytearray | memoryview)
             else len(tokens)) // block_size
    if n_blocks is not None:
        count = min(count, n_blocks)
    if count <= 0:
        return []
    raw = bytes(block_bytes(tokens, count * block_size))
    seed, step, digest = ns_seed(ns), 4 * block_size, xxhash.xxh3_128_digest
    out: list[bytes] = []
    h = bytes(parent)
    for off in range(0, count * step, step):
        h = digest(h + raw[off: off + step], seed)
        out.append(h)
    return out


def block_id(digest: bytes) -> int:
    """The 64-bit id a block travels and is indexed under: the digest's first 8 bytes, little-endian."""
    return int.from_bytes(digest[:8], "little")


def block_ids(ns: bytes, tokens: Sequence[int] | np.ndarray | bytes | memoryview, block_size: int,
              n_blocks: int | None = None) -> list[int]:
    """The ids of a prompt's whole blocks in namespace `ns`, in order (what a worker holding it reports)."""
    return [block_id(h) for h in chain(ns, ns, tokens, block_size, n_blocks)]
