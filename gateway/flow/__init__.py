"""flow."""
