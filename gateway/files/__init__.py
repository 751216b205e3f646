"""The Files API (`/v1/files`): batch input files per tenant on a storage interface (by default a folder)."""
