"""The Batch API (`/v1/batches`): records in Redis, the HTTP handlers and the work loop every gateway runs."""
