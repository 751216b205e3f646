"""Money admission: an organization -> project -> key -> user hierarchy of dollar budgets, prices, spend."""

from admission.money.errors import BudgetExceeded, LevelRateLimited
from admission.money.keys import DEFAULT_ORG, LEVELS
from admission.money.ledger import MoneyHold, MoneyLedger, MoneyPath
from admission.money.prices import Price, PriceBook

__all__ = ["DEFAULT_ORG", "LEVELS", "BudgetExceeded", "LevelRateLimited", "MoneyHold", "MoneyLedger",
           "MoneyPath", "Price", "PriceBook"]
