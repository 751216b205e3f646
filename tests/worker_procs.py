"""Test helper: start real `switchyard worker` processes and stop them for sure (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent


class WorkerProc:
    def __init__(self, log_dir: Path, *, model: str = "tiny-random", extra: list[str] | None = None,
                 redis_url: str | None = None, worker_id: str | None = None, threads: int = 1,
                 port: int | None = None) -> None:
        self.port = port or free_port()  # a restarted worker may take its old port back
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"worker-{self.port}.log"
        cmd = [sys.executable, "-m", "config.cli", "worker", "--model", model, "--bind", self.endpoint,
               "--num-threads", str(threads), "--kv-cache-bytes", str(64 << 20), *(extra or [])]
        if redis_url:
            cmd += ["--redis-url", redis_url]
        if worker_id:
            cmd += ["--worker-id", worker_id]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, grace: float = 5.0) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            self._log.close()
