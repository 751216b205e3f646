"""Admission: per-tenant token budgets in Redis, then KV capacity, with load shedding.

The package face: callers import from `admission`, not from its modules.
"""

from admission.budget import Budget, Reservation
from admission.capacity import (
    CapacityGate,
    CapacityNeverFits,
    CapacityTicket,
    Overloaded,
    TtftUnattainable,
    WorkerCapacity,
)
from admission.gate import Admission, AdmissionTicket, ErrorSpec, error_response
from admission.gateways import GatewayRegistry
from admission.headers import format_duration, rate_limit_headers, retry_headers
from admission.hold import BudgetGuard
from admission.local_limits import LocalLimiter
from admission.metering import DayUsage, read_usage
from admission.money import BudgetExceeded, LevelRateLimited, MoneyHold, MoneyPath, Price
from admission.money.admin_keys import admin_key_key, admin_key_shape_ok, parse_admin_key
from admission.money.keys import (
    DEFAULT_ORG,
    ORGS_SET,
    PROJECT_ORG_KEY,
    model_family,
    model_ident,
    spend_key,
    user_ident,
    validate_org,
)
from admission.money.keys import config_key as level_config_key
from admission.money.money_gate import MoneyGate
from admission.results import (
    ADMITTED,
    DENIED,
    NEVER_FITS,
    BudgetError,
    QuotaExceeded,
    Renewal,
    RequestTooLarge,
    ReserveResult,
    TenantRejected,
    error_for,
)
from admission.ttft_predict import TtftTarget

__all__ = [
    "DEFAULT_ORG",
    "ORGS_SET",
    "PROJECT_ORG_KEY",
    "admin_key_key",
    "admin_key_shape_ok",
    "parse_admin_key",
    "spend_key",
    "user_ident",
    "level_config_key",
    "model_family",
    "model_ident",
    "validate_org",
    "ADMITTED",
    "DENIED",
    "NEVER_FITS",
    "Admission",
    "AdmissionTicket",
    "Budget",
    "BudgetError",
    "BudgetExceeded",
    "BudgetGuard",
    "LevelRateLimited",
    "CapacityGate",
    "CapacityNeverFits",
    "CapacityTicket",
    "DayUsage",
    "ErrorSpec",
    "GatewayRegistry",
    "LocalLimiter",
    "MoneyGate",
    "MoneyHold",
    "MoneyPath",
    "Overloaded",
    "Price",
    "QuotaExceeded",
    "Renewal",
    "RequestTooLarge",
    "ReserveResult",
    "Reservation",
    "TenantRejected",
    "TtftTarget",
    "TtftUnattainable",
    "WorkerCapacity",
    "error_for",
    "error_response",
    "format_duration",
    "rate_limit_headers",
    "read_usage",
    "retry_headers",
]
