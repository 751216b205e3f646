"""Shared fixtures: a private redis-server per test session, free ports, model paths."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only under its interpreter, and triton takes the switch when a kernel is
# defined: set it before any test module can import triton, whatever the collection order (`make test-gpu`
# runs with --noconftest, so natively)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the host tiers' shared budget (worker.kvcache.tiers.host_budget): one claims file per test session, so that
# no process outside it (a `make run` left running) holds this session's workers' shares
os.environ.setdefault("SWITCHYARD_HOST_CLAIMS", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"sy-host-claims-{os.getpid()}.json"))

# re-exported to the tests
from config.local_stack.launcher import free_port, wait_for_port  # noqa: E402, F401
from tests.gateway_stack import GatewayStack, shared_stack, stop_shared_stack  # noqa: E402


class RedisServer:
    """A real redis-server on a free loopback port, owned by the tests (restartable). With `data_dir`
    it keeps a dump file there, so `stop()` (which saves first) then `start()` brings its data back."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not installed: run `make test`, which installs it")
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        dump = ["--dir", str(self.data_dir), "--dbfilename", "dump.rdb"] if self.data_dir else []
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *dump, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self, save: bool = True) -> None:
        if self.proc is None:
            return
        if save and self.data_dir is not None:
            import redis

            client = redis.Redis.from_url(self.url, socket_timeout=5)
            client.save()
            client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's redis-server, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture()
def r(redis_url: str):
    """A blocking client of the session's redis-server (flushed), closed after the test."""
    from tenancy.redis_client import sync_client

    client = sync_client(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def stack() -> Iterator[GatewayStack]:
    """The shared redis + default-model worker + gateway stack (`tests.gateway_stack`). Modules that
    need a differently configured stack define their own `stack` fixture, which takes precedence."""
    yield shared_stack()
    stop_shared_stack()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--order", default="file", metavar="file|reverse|shuffle:SEED",
                     help="run the collected tests in file order, reversed, or shuffled with a seed: "
                          "a test whose outcome depends on what ran before it fails in one of them "
                          "(`make test-heavy-reordered`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--order")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order != "file":
        raise pytest.UsageError(f"--order={order!r}: use file, reverse or shuffle:SEED")


@pytest.fixture(scope="module", autouse=True)
def _module_torch_threads() -> Iterator[None]:
    """torch's thread count is process-wide, and the kernels (and the kernel choices,
    stored per thread count) a model runs depend on it: a module that sets it gets it
    back at its end, so no later module sees its choice."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _test_torch_threads(_module_torch_threads: None) -> Iterator[None]:
    """The same for one test: what its body (or an engine it builds) sets is undone when it ends."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads() -> None:
    # Two cores: keep torch from oversubscribing when worker processes run beside the tests.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture()
def spans() -> Iterator[object]:
    """Tracing on for one test: every span goes to an in-memory exporter (`spans.get_finished_spans()`)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common.trace_context import set_tracer_provider

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        set_tracer_provider(None)
        provider.shutdown()
