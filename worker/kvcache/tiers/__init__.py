"""KV tiers below the radix cache: evicted pages kept in host RAM (and optionally on disk), restored on a
later hit.

The design, write policy and cost model are in docs/engine.md ("KV tiers").
"""
