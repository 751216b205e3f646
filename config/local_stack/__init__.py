"""local_stack."""
