"""The worker: paged-KV engine, scheduler, model runner and its ZeroMQ server. Imports no other Switchyard package."""
