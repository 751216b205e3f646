"""Exceptions shared by tenancy and admission.

`QuotaServiceUnavailable` is raised whenever Redis (the quota and tenant store)
cannot be reached within its timeout; the gateway maps it to 503
`quota_service_unavailable`. The others are operator/CLI-facing errors with
messages fit to print.
"""

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
