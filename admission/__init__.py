"""Per-tenant token budgets in Redis, capacity admission and load shedding."""
