"""API key format, generation and digests.

A key is `sy-` followed by 40 URL-safe random characters. It is shown once at
creation; Redis stores only its SHA-256 hex digest (lookup is by digest, so no
plaintext comparison ever happens) plus a short display prefix, which is not a
secret and lets operators revoke a key by prefix.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "sy-"
KEY_RANDOM_CHARS = 40
DISPLAY_PREFIX_CHARS = 10


def new_api_key() -> str:
    # token_urlsafe(30) yields exactly 40 characters of base64url.
    return KEY_PREFIX + secrets.token_urlsafe(30)[:KEY_RANDOM_CHARS]


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def display_prefix(api_key: str) -> str:
    return api_key[:DISPLAY_PREFIX_CHARS]


def new_salt() -> str:
    """The tenant's cache-namespace salt: random, made at creation, never from a client."""
    return secrets.token_hex(16)
