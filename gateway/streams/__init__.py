"""Resumable streams: every SSE event numbered, an event log per stream in Redis, and replay from any gateway."""
