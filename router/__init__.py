"""Prefix-cache-aware routing of requests to workers, and the ZeroMQ worker client."""
