"""Exceptions shared by tenancy and admission: operator-facing errors and `QuotaServiceUnavailable` (503)."""

from __future__ import annotations


class TenancyError(Exception):
    """Base class of errors with a message meant for the operator."""


class TenantNotFound(TenancyError):
    pass


class TenantExists(TenancyError):
    pass


class KeyNotFound(TenancyError):
    pass


class AmbiguousKeyPrefix(TenancyError):
    pass


class QuotaServiceUnavailable(Exception):
    """Redis (tenants, quotas, rate-limit state) is unreachable or timed out."""
