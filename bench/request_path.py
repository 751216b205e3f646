"""How many Switchyard modules one chat request runs code in, gateway and worker together (the request path).

A private stack (`make run`'s launcher) starts with `bench/calltrace/sitecustomize.py` loaded in its
children; after a warm-up request, both processes record the modules whose functions run (main thread: the
gateway's event loop, the worker's serving loop) while one streamed chat completion is served. Prints one JSON
line with the count and the modules per process; exits 1 over the target (`--max-modules`, 50).
Run: `python -m bench.request_path [--model default]` (needs redis-server).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from config.local_stack.launcher import Stack, StackConfig, free_port

TRACE_DIR = Path(__file__).with_name("calltrace")
TARGET = 50


def chat(base_url: str, key: str, model: str) -> None:
    """One streamed chat completion, read to its end."""
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Name three rivers of Europe."}]}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"}) as resp:
        resp.raise_for_status()
        for _ in resp.iter_lines():
            pass


def traced(stack: Stack, key: str, model: str, out: Path) -> dict[str, list[str]]:
    """The modules each of the worker and the gateway ran code in while serving one request."""
    procs = {name: stack.procs[name] for name in ("worker", "gateway")}
    for proc in procs.values():
        proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)  # the handlers run between bytecodes of each process's main thread
    chat(stack.base_url, key, model)
    time.sleep(0.5)  # the worker's loop ends the request (settle, stats) before the recording stops
    for proc in procs.values():
        proc.send_signal(signal.SIGUSR2)
    found = {}
    for name, proc in procs.items():
        path = Path(f"{out}.{proc.pid}")
        deadline = time.monotonic() + 10
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} wrote no trace")
            time.sleep(0.1)
        time.sleep(0.1)
        found[name] = path.read_text().split()
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-modules", type=int, default=TARGET)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sy-path-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRACE_DIR), os.environ.get("PYTHONPATH")]))
    os.environ["SWITCHYARD_CALLTRACE"] = str(tmp / "trace")
    stack = Stack(StackConfig(port=free_port(), model=args.model, log_dir=tmp))
    stack.start()
    try:
        stack.wait_ready(180)
        key = stack.create_tenant("path", tpm=0, rpm=0, max_concurrent=0)
        chat(stack.base_url, key, args.model)  # warm-up: lazy imports and first-use caches are not counted
        found = traced(stack, key, args.model, tmp / "trace")
    finally:
        stack.stop()
    modules = sorted(set(found["gateway"]) | set(found["worker"]))
    result = {"modules": len(modules), "gateway_modules": len(found["gateway"]),
              "worker_modules": len(found["worker"]), "target": args.max_modules, "model": args.model,
              "gateway": found["gateway"], "worker": found["worker"]}
    print(json.dumps(result))
    return 0 if len(modules) <= args.max_modules else 1


if __name__ == "__main__":
    sys.exit(main())
