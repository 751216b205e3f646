"""Resumable streams: every SSE event numbered, an event log per stream in Redis, replay from any gateway."""
