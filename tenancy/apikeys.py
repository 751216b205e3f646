"""API key format, generation and digests: Redis stores only a key's SHA-256 digest and a display prefix."""

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
