"""Requests whose grammar is still compiling: held out of the scheduler, each with a deadline, and handed
over once their compile is done; nothing here waits on a compile.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from worker.engine.records.request_errors import RequestError, bad_request
from worker.engine.records.sequence import Sequence
from worker.protocol.grammar_spec import GrammarError
from worker.sample.grammar import CacheKey, CompiledGrammar, GrammarBusy, GrammarCache, GrammarState

# llguidance compiles a schema in milliseconds; this bounds a pathological one
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Waiting:
    seq: Sequence
    key: CacheKey
    future: concurrent.futures.Future[CompiledGrammar]
    deadline: float  # time.monotonic()


class CompileWait:
    """Sequences waiting for their grammar; `settle` releases the ready ones and fails the expired ones."""

    def __init__(self, cache: GrammarCache, timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self._waiting: dict[str, _Waiting] = {}

    def submit(self, wire: dict,
               namespace: bytes) -> tuple[CacheKey, concurrent.futures.Future[CompiledGrammar]]:
        """Start (or join) the compile of a request's grammar: (its key, the future). RequestError for a bad
        map, a cached failure, or a pending bound (retryable "capacity")."""
        try:
            key, future = self.cache.request(wire, namespace)
        except GrammarError as e:
            raise bad_request(e.message, e.param) from None
        except GrammarBusy as e:
            raise RequestError("capacity", str(e), retryable=True) from None
        if future.done() and not future.cancelled() and isinstance(future.exception(), GrammarError):
            error = future.exception()
            raise bad_request(error.message, error.param)  # type: ignore[union-attr]
        return key, future

    def hold(self, seq: Sequence, key: CacheKey, future: concurrent.futures.Future[CompiledGrammar]) -> None:
        """Keep `seq` until `future` is done or the compile deadline passes."""
        self._waiting[seq.rid] = _Waiting(seq, key, future, time.monotonic() + self.timeout_s)

    def ready(self) -> bool:
        """Some held request can be settled now (its compile is done, or its deadline passed)."""
        now = time.monotonic()
        return any(w.future.done() or now >= w.deadline for w in self._waiting.values())

    def settle(self) -> tuple[list[Sequence], list[tuple[str, RequestError]]]:
        """(sequences whose matcher is ready, (rid, error) of requests that failed)."""
        ready: list[Sequence] = []
        failed: list[tuple[str, RequestError]] = []
        now = time.monotonic()
        for rid, w in list(self._waiting.items()):
            if w.future.done():
                del self._waiting[rid]
                error = _compile_error(w.future)
                if error is None:
                    w.seq.grammar = w.future.result().new_state()
                    ready.append(w.seq)
                else:
                    failed.append((rid, error))
            elif now >= w.deadline:
                self._drop(rid)
                failed.append((rid,
                               RequestError("capacity", "grammar compilation timed out", retryable=True)))
        return ready, failed

    def remove(self, rid: str) -> Sequence | None:
        """Take a held request out (abort); its compile is cancelled if nobody else waits for it."""
        w = self._waiting.get(rid)
        if w is None:
            return None
        self._drop(rid)
        return w.seq

    def _drop(self, rid: str) -> None:
        w = self._waiting.pop(rid)
        if not any(o.future is w.future for o in self._waiting.values()):
            self.cache.abandon(w.key)

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for any held compile (in-process callers with nothing else to run)."""
        futures = [w.future for w in self._waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self._waiting)


def _compile_error(future: concurrent.futures.Future[CompiledGrammar]) -> RequestError | None:
    if future.cancelled():
        return RequestError("capacity", "grammar compilation was cancelled", retryable=True)
    error = future.exception()
    if error is None:
        return None
    if isinstance(error, GrammarError):
        return bad_request(error.message, error.param)
    return RequestError("internal", "grammar compilation failed", retryable=False)


def ready_state(future: concurrent.futures.Future[CompiledGrammar] | None) -> GrammarState | None:
    """A new matcher when the compile is already done and good (a cache hit); None otherwise."""
    if future is None or not future.done() or future.cancelled() or future.exception() is not None:
        return None
    return future.result().new_state()


def replay_output(seq: Sequence) -> bool:
    """Advance a resumed request's grammar over the output it already has; False if the grammar refuses it."""
    return all(seq.grammar.accept(tok) for tok in seq.tokens[seq.prompt_len:])  # type: ignore[union-attr]

