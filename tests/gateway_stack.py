"""One real Switchyard stack (Redis, a worker with the default model, a gateway) shared by a pytest session.

The worker runs without prefix cache (so `kv_free` returns exactly to idle) and in fp32 (so greedy
answers match Hugging Face's).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from config.local_stack.launcher import Stack, StackConfig, free_port
from tenancy.redis_client import sync_client

_STACK: GatewayStack | None = None


@dataclass(slots=True)
class GatewayStack:
    stack: Stack
    key: str  # tenant "acme": default quotas
    limited_key: str  # tenant "small": max_tokens 64, allowed only "other-model"
    batch_key: str  # tenant "bulk": batch priority

    @property
    def base_url(self) -> str:
        return self.stack.base_url


def start_gateway_stack(*, worker_model: str = "default", prefix_cache: bool = False,
                        worker_args: Sequence[str] = (),
                        gateway_args: Sequence[str] = ("--max-body-bytes", "1000000",
                                                       "--worker-timeout", "20",
                                                       "--stream-detach-grace", "0"),
                        ) -> GatewayStack:
    """A new stack with the three tenants; the caller stops it (`stack.stack.stop()`).

    `worker_model` picks the worker's model ("tiny-random" for tests that need no real
    answers); the gateway always tokenizes with the default model's tokenizer.
    """
    logs = Path(tempfile.mkdtemp(prefix="sy-gw-test-"))
    wargs = ["--model", worker_model, "--dtype", "float32", "--quantization", "none", "--kv-dtype", "model",
             *([] if prefix_cache else ["--no-prefix-cache"]),
             *worker_args]
    stack = Stack(StackConfig(port=free_port(), log_dir=logs, ready_timeout=240.0, worker_args=wargs,
                              gateway_args=[*gateway_args, "--files-dir", str(logs / "files")]))
    stack.start()
    try:
        return GatewayStack(stack, stack.create_tenant("acme"),
                            stack.create_tenant("small", max_tokens=64, allowed_models="other-model"),
                            stack.create_tenant("bulk", priority="batch"))
    except BaseException:
        stack.stop()
        raise


def shared_stack() -> GatewayStack:
    global _STACK
    if _STACK is None:
        _STACK = start_gateway_stack()
    return _STACK


def stop_shared_stack() -> None:
    global _STACK
    if _STACK is not None:
        _STACK.stack.stop()
        _STACK = None


def tenant_state(redis_url: str, name: str) -> dict:
    """A dump of every Redis key of tenant `name` but its config: equal before and after means nothing was
    charged, reserved or leased."""
    r = sync_client(redis_url)
    try:
        return {k: r.dump(k) for k in sorted(r.scan_iter(match=f"{{t:{name}}}:*"))
                if not k.endswith(b":config")}
    finally:
        r.close()


def charged_as_invalid(redis_url: str, name: str, before: dict) -> bool:
    """After a request refused as invalid (tenant with default limits): nothing but the rate bucket changed,
    and that by one request of `rpm`, no tokens (tenants.md: an invalid request costs one request)."""
    from tenancy.schema import INT_DEFAULTS, bucket_key

    after = tenant_state(redis_url, name)
    bucket = bucket_key(name).encode()
    if {k: v for k, v in after.items() if k != bucket} != {k: v for k, v in before.items() if k != bucket}:
        return False
    r = sync_client(redis_url)
    try:
        tok, req = (float(v) for v in r.hmget(bucket, "tok", "req"))
    finally:
        r.close()
    return tok == INT_DEFAULTS["tpm"] and INT_DEFAULTS["rpm"] - 1 <= req < INT_DEFAULTS["rpm"] - 0.9
