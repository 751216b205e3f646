"""Start and stop the batch work loop with the app's lifespan (when the gateway has a files directory)."""

from __future__ import annotations

import functools

from starlette.applications import Starlette

from gateway.batches.batch_routes import service_execute
from gateway.batches.batch_runner import BatchRunner, RunnerConfig
from gateway.batches.batch_store import BatchStore


def start_batches(app: Starlette) -> None:
    """The Batch API and this gateway's runner (`batch_concurrency` lines at once)."""
    svc = app.state.service
    app.state.batches = app.state.batch_runner = None
    if app.state.files is None or app.state.redis is None:
        return
    store = BatchStore(app.state.redis)
    app.state.batches = store
    runner = BatchRunner(store, app.state.files, functools.partial(service_execute, svc),
                         RunnerConfig(concurrency=app.state.config.batch_concurrency,
                                      claim_idle_s=app.state.config.batch_claim_idle_s))
    runner.start()
    app.state.batch_runner = runner


async def stop_batches(app: Starlette) -> None:
    """Drain: lines in flight finish (bounded); unacknowledged ones are reclaimed by another gateway."""
    runner = getattr(app.state, "batch_runner", None)
    if runner is not None:
        await runner.stop()
