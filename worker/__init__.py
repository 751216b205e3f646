"""The worker: paged-KV engine, scheduler, model runner, ZeroMQ server; imports no other Switchyard code."""
