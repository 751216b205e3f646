"""Tenants, API keys and quotas as they live in Redis.

The package face: callers import from `tenancy`, not from its modules.
"""

from tenancy.apikeys import digest as key_digest
from tenancy.apikeys import new_salt
from tenancy.directory import TenantDirectory, key_shape_ok
from tenancy.redis_client import async_client, sync_client
from tenancy.schema import (
    ACTIVE,
    BATCH,
    DISABLED,
    INTERACTIVE,
    PRIORITIES,
    STATUSES,
    TENANTS_SET,
    Tenant,
    api_key_key,
    bucket_key,
    config_key,
    leases_key,
    tag,
    tenant_keys_key,
    usage_key,
    validate_name,
)
from tenancy.tenancy_errors import (
    AmbiguousKeyPrefix,
    KeyNotFound,
    QuotaServiceUnavailable,
    TenancyError,
    TenantExists,
    TenantNotFound,
)
from tenancy.tenant_admin import (
    KeyInfo,
    create_tenant,
    get_tenant,
    issue_key,
    list_keys,
    list_tenants,
    revoke_key,
    set_status,
    tenant_with_new_key,
    update_tenant,
)

__all__ = [
    "TENANTS_SET",
    "new_salt",
    "tenant_keys_key",
    "validate_name",
    "key_shape_ok",
    "key_digest",
    "ACTIVE",
    "BATCH",
    "DISABLED",
    "INTERACTIVE",
    "PRIORITIES",
    "STATUSES",
    "AmbiguousKeyPrefix",
    "KeyInfo",
    "KeyNotFound",
    "QuotaServiceUnavailable",
    "TenancyError",
    "Tenant",
    "TenantDirectory",
    "TenantExists",
    "TenantNotFound",
    "api_key_key",
    "async_client",
    "bucket_key",
    "config_key",
    "create_tenant",
    "get_tenant",
    "issue_key",
    "leases_key",
    "tag",
    "list_keys",
    "list_tenants",
    "revoke_key",
    "set_status",
    "sync_client",
    "tenant_with_new_key",
    "update_tenant",
    "usage_key",
]
