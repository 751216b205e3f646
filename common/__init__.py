"""The shared floor: what every Switchyard package uses (priorities, Redis clients, tracing, registry keys).

It imports nothing of Switchyard's; each module is imported by its own path.
"""
