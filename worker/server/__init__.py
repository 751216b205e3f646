"""The worker process: ZeroMQ serving loop, request ownership, drain, link auth, registration, stats, metrics
and memory bounds.
"""
