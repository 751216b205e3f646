"""The Files API (`/v1/files`): batch input files per tenant, on a storage interface (a directory by default)."""
