"""`make run`'s launcher from this checkout: it prints a curl line, and that line gets an answer.

Runs `python -m config.local_stack.launcher` on a free port with its own private redis-server
(SWITCHYARD_REDIS_URL unset), executes the printed curl command, then stops the
launcher with two SIGTERMs in a row and checks that every process it started is gone; a launcher SIGKILLed
takes its children with it (they are tied to it by PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from config.local_stack.launcher import free_port
from tests import REPO


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(port: int, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    env["SWITCHYARD_WORKER__DTYPE"] = "float32"
    return subprocess.Popen([sys.executable, "-m", "config.local_stack.launcher", "--port", str(port),
                             "--ready-timeout", "240",
                             "--log-dir", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"sy-make-run-{port}"),
                             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def curl_line_of(proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 300
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("curl "):
            return line.strip()
    raise AssertionError("launcher printed no curl line:\n" + "".join(lines))


def gone_within(pids: list[int], port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not [pid for pid in pids if alive(pid)] and port_free(port):
            return True
        time.sleep(0.2)
    return False


def test_launcher_prints_a_working_curl_line():
    port = free_port()
    proc = launch(port)
    started: list[int] = []
    try:
        curl = curl_line_of(proc)
        assert f"127.0.0.1:{port}" in curl and re.search(r"Bearer sy-[A-Za-z0-9_-]+", curl)
        started = children_of(proc.pid)
        assert len(started) == 3  # redis-server, worker, gateway
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=180)
        body = json.loads(out.stdout)
        assert body["object"] == "chat.completion"
        assert "Paris" in body["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # a second one during the stop changes nothing
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert not [pid for pid in started if alive(pid)] and port_free(port)


def test_a_sigkilled_launcher_takes_its_children_with_it():
    port = free_port()
    proc = launch(port)
    try:
        curl_line_of(proc)
        started = children_of(proc.pid)
        assert len(started) == 3
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert gone_within(started, port, 30), [pid for pid in started if alive(pid)]


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may return the same free port to two binds in a row; two workers told to listen there
    race."""
    import config.local_stack.launcher as launcher

    ports = iter([41000, 41000, 41000, 41001])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            self.port = next(ports)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher.socket, "socket", FakeSocket)
    monkeypatch.setattr(launcher, "_HANDED_OUT", launcher.deque(maxlen=8))
    assert [launcher.free_port(), launcher.free_port()] == [41000, 41001]
