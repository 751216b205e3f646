"""The Lua scripts of admission and their EVALSHA caller (`scripts.py`)."""
