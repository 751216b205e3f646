"""Composition root: typed settings, the `switchyard` CLI and the process launcher."""
