"""Switchyard's worker protocol in front of vLLM's engine (`switchyard worker --engine vllm`;
docs/vllm-engine.md).

vLLM is an optional extra: nothing here imports it until a vLLM-engine worker starts.
"""
