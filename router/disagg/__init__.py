"""disagg."""
