"""The administration API in OpenAI's shape: projects, their API keys, usage and costs, for admin keys."""
