"""The batch work loop every gateway runs: read lines from the shared stream (consumer group), reclaim lines
whose claimer went silent (XAUTOCLAIM past `claim_idle_s`), run each through `execute`, record its result once
(HSETNX), and write the output and error files when the last line is in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.batches.batch_store import GROUP, STREAM, Batch, BatchStore, _text
from gateway.files.file_store import FileStore

log = logging.getLogger("switchyard.gateway")

RETRIED = frozenset({429, 503})  # refusals for lack of budget or capacity: tried again until the window ends
MAX_RETRY_WAIT_S = 30.0
# (tenant, batch, line) -> (status code, body); the line's own request through admission and a worker
Execute = Callable[[str, Batch, dict], Awaitable[tuple[int, dict]]]


@dataclass(slots=True)
class RunnerConfig:
    concurrency: int = 4  # lines in flight on one gateway
    claim_idle_s: float = 60.0  # a line claimed this long ago and not acknowledged is taken over
    block_ms: int = 250  # one XREADGROUP waits at most this long (below the clients' 0.5 s read timeout)
    stop_wait_s: float = 10.0  # a stop waits this long for lines in flight (the rest are reclaimed elsewhere)


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileStore, execute: Execute,
                 config: RunnerConfig | None = None,
                 name: str | None = None) -> None:
        self.store, self.files, self.execute = store, files, execute
        self.config = config or RunnerConfig()
        self.name = name or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self._slots = asyncio.Semaphore(self.config.concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run(), name="batch runner")

    async def stop(self) -> None:
        """Stop reading; wait (bounded) for lines in flight; another gateway reclaims the unfinished ones."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.wait({self._loop}, timeout=self.config.stop_wait_s)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.stop_wait_s)
        for task in self._tasks:
            task.cancel()

    async def _run(self) -> None:
        with contextlib.suppress(Exception):  # BUSYGROUP: another gateway made it
            await self.store.redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        while True:
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down: try again shortly
                log.warning("batch runner: %s", type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _round(self) -> None:
        await self._slots.acquire()
        self._slots.release()
        free = self._slots._value  # noqa: SLF001 - how many lines this gateway may take now
        r = self.store.redis
        idle_ms = int(self.config.claim_idle_s * 1000)
        _, entries, *_ = await r.xautoclaim(STREAM, GROUP, self.name, idle_ms, "0", count=free)
        if not entries:
            got = await r.xreadgroup(GROUP, self.name, {STREAM: ">"}, count=free, block=self.config.block_ms)
            entries = got[0][1] if got else []
        for entry_id, fields in entries:
            await self._slots.acquire()
            decoded = {_text(k): _text(v) for k, v in fields.items()}
            task = asyncio.create_task(self._guarded(entry_id, decoded))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _guarded(self, entry_id: bytes | str, f: dict[str, str]) -> None:
        """A line that failed on Redis stays unacknowledged: a runner takes it over after `claim_idle_s`."""
        beat = asyncio.create_task(self._keep_claimed(entry_id))
        try:
            await self._line(entry_id, f)
        except Exception as exc:
            log.warning("batch runner: line %s of %s: %s", f.get("n"), f.get("b"), type(exc).__name__)
        finally:
            beat.cancel()

    async def _keep_claimed(self, entry_id: bytes | str) -> None:
        """While a line runs, its claim is renewed (XCLAIM resets its idle time): no runner takes it over."""
        while True:
            await asyncio.sleep(self.config.claim_idle_s / 3)
            with contextlib.suppress(Exception):
                await self.store.redis.xclaim(STREAM, GROUP, self.name, 0, [entry_id], justid=True)

    async def _line(self, entry_id: bytes | str, f: dict[str, str]) -> None:
        tenant, batch_id, n = f["t"], f["b"], int(f["n"])
        batch = await self.store.get(tenant, batch_id)
        if batch is not None and not await self.store.has_result(tenant, batch_id, n):
            await self.store.put_result(tenant, batch_id, n, await self._answer(tenant, batch, int(f["o"])))
        await self.store.redis.xack(STREAM, GROUP, entry_id)
        await self.store.redis.xdel(STREAM, entry_id)
        if batch is not None:
            await self.maybe_finalize(tenant, batch_id)

    async def _answer(self, tenant: str, batch: Batch, offset: int) -> dict:
        """Line n's result: `skip` (cancelled or expired before it ran), a response, or an error."""
        if batch.status in ("cancelling", "cancelled") or time.time() > batch.expires_at:
            return {"skip": True}
        line = await asyncio.to_thread(_read_line, self.files, tenant, batch.input_file_id, offset)
        if line is None:
            return {"error": {"code": "file_not_found", "message": "The input file was deleted."}}
        wait = 1.0
        while True:
            try:
                status, body = await self.execute(tenant, batch, line["body"])
            except Exception:
                log.exception("batch %s: a line failed", batch.id)
                status, body = 500, {"error": {"message": "Internal server error.", "type": "server_error"}}
            if status not in RETRIED or time.time() + wait > batch.expires_at:
                return {"custom_id": line["custom_id"], "status_code": status, "body": body}
            await asyncio.sleep(wait)  # out of budget or capacity for now: batch work waits, it does not fail
            wait = min(wait * 2, MAX_RETRY_WAIT_S)
            now = await self.store.get(tenant, batch.id)
            if now is None or now.status != "in_progress":
                return {"skip": True}

    async def maybe_finalize(self, tenant: str, batch_id: str) -> None:
        """When every line has a result: write the files and set the final status (one gateway does)."""
        batch = await self.store.get(tenant, batch_id)
        if batch is None or batch.status not in ("in_progress", "cancelling"):
            return
        if await self.store.result_count(tenant, batch_id) < batch.total:
            return
        if not await self.store.claim_finalize(tenant, batch_id):
            return
        batch = await self.store.update(tenant, batch_id, ("in_progress", "cancelling"), status="finalizing",
                                        finalizing_at=int(time.time()))
        if batch is None or batch.status != "finalizing":
            return
        results = await self.store.results(tenant, batch_id)
        out, err = await asyncio.to_thread(_write_files, self.files, tenant, batch_id, results)
        ok = sum(1 for r in results.values() if r.get("status_code") == 200)
        failed = sum(1 for r in results.values() if not r.get("skip")) - ok
        now = int(time.time())
        final = "cancelled" if batch.cancelling_at is not None else \
            "expired" if any(r.get("skip") for r in results.values()) else "completed"
        await self.store.update(tenant, batch_id, status=final, output_file_id=out, error_file_id=err,
                                counts={"total": batch.total, "completed": ok, "failed": failed},
                                **{f"{final}_at": now})


def _read_line(files: FileStore, tenant: str, file_id: str, offset: int) -> dict | None:
    """The request line at byte `offset` of a stored input file."""
    path = files.content_path(tenant, file_id)
    if path is None:
        return None
    with open(path, "rb") as fh:
        fh.seek(offset)
        return json.loads(fh.readline())


def _write_files(files: FileStore, tenant: str, batch_id: str,
                 results: dict[int, dict]) -> tuple[str | None, ...]:
    """The output file (lines answered 200) and the error file (the others), in OpenAI's line format."""
    outs: list[bytes] = []
    errs: list[bytes] = []
    for n in sorted(results):
        r = results[n]
        if r.get("skip") or "custom_id" not in r:
            continue
        line = {"id": f"batch_req_{batch_id[6:]}_{n}", "custom_id": r["custom_id"],
                "response": {"status_code": r["status_code"], "request_id": f"{batch_id}-{n}",
                             "body": r["body"]},
                "error": None}
        (outs if r["status_code"] == 200 else errs).append(json.dumps(line).encode() + b"\n")
    ids: list[str | None] = []
    for kind, lines in (("output", outs), ("error", errs)):
        if not lines:
            ids.append(None)
            continue
        staged = files.staging(tenant)
        staged.write_bytes(b"".join(lines))
        ids.append(files.put(tenant, f"{batch_id}_{kind}.jsonl", f"batch_{kind}", staged).id)
    return tuple(ids)
