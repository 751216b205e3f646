"""OpenAI-compatible HTTP front door: auth, validation, streaming (Starlette)."""
