"""Tenants, API keys (stored as SHA-256 digests) and quotas in Redis."""
