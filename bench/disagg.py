"""Disaggregated prefill vs colocated (two workers pinned to a core each): steady streams' ITL, throughput and
SLO goodput while long prompts arrive; one JSON line (docs/benchmarks.md). The colocated arm runs once per
`--prefill-chunk` (default 1024, 256, 128), each ratio against the chunk best at it; the disaggregated arm at
the first chunk; workers at the serving dtype. Exits 1 on a missed target, a failed request or a local
fallback (`--no-targets`: 0). Run: `python -m bench.disagg`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.disagg_workload import (
    Sample,
    Slo,
    Workload,
    against_best,
    arm_numbers,
    greedy_compare,
    long_prompt,
    long_schedule,
    ratios,
    short_turn,
)
from bench.machine import (
    add_no_targets,
    busy_cpu_s,
    cores_of,
    cpu_model,
    exit_code,
    own_cpu_s,
    pinned,
    serving_dtype,
)
from config.local_stack.launcher import GatewayProc, WorkerProc, free_port, start_redis_server

ROLES = {"colocated": ("both", "both"), "disagg": ("prefill", "decode")}  # the workers on cores 0 and 1
TARGETS = {"itl_p99_ratio_max": 0.5, "throughput_ratio_min": 0.9, "goodput_ratio_min": 1.3}
READ_TIMEOUT_S = 300.0


def stop_proc(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class Arm:
    """One arm's processes: two pinned workers and a gateway that knows them statically."""

    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path, redis_url: str,
                 chunk: int) -> None:
        self.name, self.workers, self.metrics_ports, self.gateway = name, [], [], None
        log_dir = log_dir / f"{name}-{chunk}"
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(args, log_dir, redis_url, chunk)
        except BaseException:
            self.stop()
            raise

    def _start(self, args: argparse.Namespace, log_dir: Path, redis_url: str, chunk: int) -> None:
        for core, role in enumerate(ROLES[self.name]):
            port = free_port()
            extra = ["--role", role, "--dtype", args.dtype, "--quantization", args.quantization,
                     "--kv-dtype", args.kv_dtype, "--kv-cache-bytes", str(args.kv_cache_mib << 20),
                     "--kv-host-bytes", "0", "--spec-tokens", "0", "--metrics-port", str(port),
                     "--metrics-host", "127.0.0.1", "--drain-timeout", "5",
                     "--max-num-batched-tokens", str(chunk)]
            if args.stall_s is not None:
                extra += ["--disagg-stall-s", str(args.stall_s)]
            with pinned(core):
                self.workers.append(WorkerProc(log_dir, model=args.model, threads=1, extra=extra))
            self.metrics_ports.append(port)
        self.gateway = GatewayProc.spawn(log_dir, [
            "--redis-url", redis_url, "--model", "default", "--worker-timeout", "10",
            "--workers", ",".join(w.endpoint for w in self.workers),
            "--disagg-min-tokens", str(args.disagg_min_tokens),
            "--disagg-max-prefill-queue", str(args.disagg_max_prefill_queue)])

    def wait_ready(self, timeout: float) -> None:
        """The gateway answers /ready and has heard stats from both workers."""
        deadline = time.monotonic() + timeout
        while not (self.gateway.ready() and heard(self.gateway.base_url) >= 2):
            dead = [p.args for p in [self.gateway.proc, *(w.proc for w in self.workers)]
                    if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{self.name}: a process exited during start-up: {dead[0]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not ready after {timeout}s "
                                   f"(logs in {self.workers[0].log_path.parent})")
            time.sleep(0.5)

    def pinning(self) -> dict[str, list[str]]:
        return {f"{role}@{core}": cores_of(w.proc.pid)
                for core, (role, w) in enumerate(zip(ROLES[self.name], self.workers, strict=True))}

    def stop(self) -> None:
        """Gateway first, then each worker, every one tried whatever the others do."""
        procs = [self.gateway, *self.workers] if self.gateway is not None else self.workers
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop()


def heard(base: str) -> int:
    """Workers the gateway has had stats from (each gets a hit-rate series)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return len(re.findall(r"^switchyard_router_prefix_hit_rate\{", text, re.M))


def counters(url: str, name: str, label: str) -> dict[str, float]:
    """A counter's `_total` samples at `url`, by the value of `label`."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^" + re.escape(name) + r"_total(?:\{([^}]*)\})? (\S+)$",
                         httpx.get(url, timeout=10).text, re.M):
        key = re.search(label + r'="([^"]*)"', m.group(1) or "")
        value = key.group(1) if key else label
        out[value] = out.get(value, 0.0) + float(m.group(2))
    return out


def scrape(arm: Arm) -> dict:
    gw = arm.gateway.base_url + "/metrics"
    workers = [f"http://127.0.0.1:{p}/metrics" for p in arm.metrics_ports]
    return {"gateway_requests": counters(gw, "switchyard_disagg_requests", "outcome"),
            "gateway_fallbacks": counters(gw, "switchyard_disagg_fallbacks", "reason"),
            "worker_transfers": [counters(u, "switchyard_worker_disagg_transfers", "outcome")
                                 for u in workers],
            "worker_fallbacks": [counters(u, "switchyard_worker_disagg_fallbacks", "reason")
                                 for u in workers], "worker_mib": [transfer_mib(u) for u in workers]}


def transfer_mib(url: str) -> dict[str, float]:
    """KV page MiB a worker pushed (prefill) and received (decode)."""
    pushed = counters(url, "switchyard_worker_disagg_pushed_bytes", "pushed")
    received = counters(url, "switchyard_worker_disagg_received_bytes", "received")
    return {k: round(v / (1 << 20), 3) for k, v in {**pushed, **received}.items()}


def delta(after: object, before: object) -> object:
    """`after - before` through nested dicts and lists of counters; zero entries left out."""
    if isinstance(after, dict):
        out = {k: delta(v, before.get(k, 0.0) if isinstance(before, dict) else 0.0) for k, v in after.items()}
        return {k: v for k, v in out.items() if v not in (0, 0.0, {}, [])}
    if isinstance(after, list):
        return [delta(a, b) for a, b in zip(after, before, strict=True)]
    return round(after - before, 3)


async def stream_one(http: httpx.AsyncClient, url: str, key: str, model: str, sample: Sample,
                     prompt: list[int], max_tokens: int) -> Sample:
    """Stream one greedy completion into `sample` (chunk arrivals, token counts, tokens); errors are kept."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    try:
        async with http.stream("POST", url, json=body, headers={"authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    sample.error = str(event["error"])[:200]
                for choice in event.get("choices", []):
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    if tokens:
                        sample.chunks.append((time.monotonic(), len(tokens)))
                        sample.tokens.extend(tokens)
                    sample.finish = choice.get("finish_reason") or sample.finish
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
    return sample


class Load:
    """The arm's client: steady streams until the window ends, long prompts at their scheduled times."""

    def __init__(self, http: httpx.AsyncClient, base: str, key: str, model: str, w: Workload) -> None:
        self.http, self.url, self.key, self.model, self.w = http, base + "/v1/completions", key, model, w
        self.samples: list[Sample] = []

    async def request(self, kind: str, index: int, prompt: list[int], max_tokens: int) -> Sample:
        sample = Sample(kind, index, len(prompt), time.monotonic())
        self.samples.append(sample)
        return await stream_one(self.http, self.url, self.key, self.model, sample, prompt, max_tokens)

    async def steady(self, stream: int, stop_at: float) -> None:
        turn = 0
        await asyncio.sleep(stream * self.w.stagger_s)
        while time.monotonic() < stop_at:
            done = await self.request("short", stream * 100_000 + turn, *short_turn(self.w, stream, turn))
            turn += 1
            if done.error is not None:  # no busy loop against a failing gateway
                await asyncio.sleep(0.5)

    async def longs(self, t0: float) -> None:
        tasks = []
        for a in long_schedule(self.w):
            await asyncio.sleep(max(0.0, t0 + a.at_s - time.monotonic()))
            tasks.append(asyncio.create_task(self.request("long", a.index, long_prompt(self.w, a),
                                                          self.w.long_max_tokens)))
        await asyncio.gather(*tasks)

    async def run(self, drain_s: float) -> float:
        """The whole schedule, then the drain of what is in flight (bounded); returns the window's start."""
        t0 = time.monotonic()
        stop_at = t0 + self.w.duration_s
        async with asyncio.timeout(self.w.duration_s + drain_s):
            await asyncio.gather(self.longs(t0), *(self.steady(s, stop_at) for s in range(self.w.streams)))
        return t0


async def warm_up(base: str, key: str, model: str, w: Workload) -> None:
    """Four short requests and two ~800-token prompts (long enough to disaggregate), none scheduled."""
    async with httpx.AsyncClient(timeout=READ_TIMEOUT_S) as http:
        load = Load(http, base, key, model, Workload(seed=w.seed + 1_000_003))
        jobs = [load.request("short", i, short_turn(load.w, i, 0)[0], 8) for i in range(4)]
        jobs += [load.request("long", i, short_turn(load.w, 9, i)[0] * 8, 4) for i in range(2)]
        async with asyncio.timeout(300):
            done = await asyncio.gather(*jobs)
    failed = [s.error for s in done if not s.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


def run_arm(name: str, chunk: int, args: argparse.Namespace, w: Workload, slo: Slo, log_dir: Path,
            redis: tuple[int, str], key: str) -> tuple[dict, list]:
    redis_pid, redis_url = redis
    arm = Arm(name, args, log_dir, redis_url, chunk)
    try:
        arm.wait_ready(args.ready_timeout)
        model = httpx.get(arm.gateway.base_url + "/v1/models", headers={"authorization": f"Bearer {key}"},
                          timeout=10).json()["data"][0]["id"]
        asyncio.run(warm_up(arm.gateway.base_url, key, model, w))
        before = scrape(arm)

        async def measure() -> tuple[float, list[Sample]]:
            async with httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10),
                                         limits=httpx.Limits(max_connections=200)) as http:
                load = Load(http, arm.gateway.base_url, key, model, w)
                return await load.run(args.drain_timeout), load.samples

        pids = [os.getpid(), arm.gateway.proc.pid, *(wp.proc.pid for wp in arm.workers), redis_pid]
        busy, own = busy_cpu_s(), own_cpu_s(pids)
        t0, samples = asyncio.run(measure())
        other = busy_cpu_s() - busy - (own_cpu_s(pids) - own)  # CPU others took from the arm (~0 if idle)
        drained = max((s.chunks[-1][0] for s in samples if s.chunks), default=t0) - t0 - w.duration_s
        numbers = {**arm_numbers(samples, slo, t0, w.duration_s), "drain_s": round(max(drained, 0.0), 3),
                   "metrics": delta(scrape(arm), before), "pinned": arm.pinning(),
                   "other_cpu_s": round(other, 1), "prefill_chunk": chunk}
        return numbers, samples
    finally:
        arm.stop()


def summary(arms: dict[str, dict], greedy: dict, args: argparse.Namespace, w: Workload, slo: Slo) -> dict:
    """`arms`: `colocated@<chunk>` per chunk and `disagg`."""
    dis = arms["disagg"]
    by_chunk = {k.split("@")[1]: ratios(dis, co) for k, co in arms.items() if k.startswith("colocated@")}
    p = against_best(by_chunk)
    remote = dis["metrics"].get("gateway_requests", {})
    met = {"itl_p99": p["itl_p99_ratio"] is not None and p["itl_p99_ratio"] <= TARGETS["itl_p99_ratio_max"],
           "throughput": p["throughput_ratio"] is not None
           and p["throughput_ratio"] >= TARGETS["throughput_ratio_min"],
           "goodput": p["goodput_ratio"] is not None and p["goodput_ratio"] >= TARGETS["goodput_ratio_min"]}
    fallbacks = sum(sum(f.values()) for f in dis["metrics"].get("worker_fallbacks", []))
    met["no_errors"] = all(a["errors"] == 0 for a in arms.values())  # a failed request is never a fast one
    met["no_fallbacks"] = fallbacks == 0  # a disagg arm that prefilled locally did not measure disaggregation
    return {
        "bench": "disagg", "cpu": cpu_model(), "model": args.model, "dtype": serving_dtype(args.dtype),
        "quantization": args.quantization, "kv_dtype": args.kv_dtype, "speculation": "off", **p,
        "against": "the colocated chunk best at each ratio", "by_chunk": by_chunk,
        "greedy_identical": greedy["compared"] > 0 and greedy["identical"] == greedy["compared"],
        "greedy": greedy, "disaggregated_requests": remote.get("remote", 0),
        "local_requests": remote.get("local", 0),
        "worker_fallbacks": fallbacks, "prefill_chunks": args.prefill_chunk, "targets": TARGETS, "met": met,
        "other_cpu_s": {name: arm["other_cpu_s"] for name, arm in arms.items()},  # others' CPU: noise
        "slo": {"ttft_short_s": slo.ttft_short_s, "ttft_long_s": f"{slo.ttft_long_base_s} + "
                f"{slo.ttft_long_per_token_s} x prompt tokens", "itl_p99_per_request_s": slo.itl_p99_s},
        "workload": {"duration_s": w.duration_s, "seed": w.seed, "streams": w.streams,
                     "short_len": w.short_len,
                     "short_max_tokens": w.short_max_tokens, "stagger_s": w.stagger_s, "long_len": w.long_len,
                     "long_max_tokens": w.long_max_tokens, "long_mean_gap_s": w.long_mean_gap_s,
                     "long_prompts": len(long_schedule(w)), "greedy": True, "ignore_eos": True},
        "setup": {"workers": "1 torch thread each, pinned (cores 0 and 1); prefill on 0, decode on 1",
                  "unpinned": "gateway, redis, load generator", "kv_cache_mib": args.kv_cache_mib,
                  "kv_host_tier": "off", "spec_decoding": "off", "disagg_min_tokens": args.disagg_min_tokens,
                  "disagg_max_prefill_queue": args.disagg_max_prefill_queue,
                  "disagg_stall_s": args.stall_s or "worker default"}, "arms": arms,
    }


def run(args: argparse.Namespace) -> dict:
    w = Workload(seed=args.seed, duration_s=args.duration, streams=args.streams,
                 long_mean_gap_s=args.long_gap,
                 long_len=(args.long_min, args.long_max), long_max_tokens=args.long_max_tokens,
                 short_max_tokens=(args.short_min_tokens, args.short_max_tokens))
    slo = Slo(args.slo_ttft_short, args.slo_ttft_long_base, args.slo_ttft_long_per_token, args.slo_itl_p99)
    log_dir = Path(tempfile.mkdtemp(prefix="sy-disagg-bench-"))
    started = time.monotonic()
    redis, url = start_redis_server(log_dir / "redis.log")
    try:
        from tenancy import tenant_with_new_key

        key = tenant_with_new_key(url, "disagg-bench", max_concurrent=1000, rpm=100_000, tpm=100_000_000)
        arms, samples = {}, {}
        first = args.prefill_chunk[0]
        for name, chunk in [*(("colocated", c) for c in args.prefill_chunk), ("disagg", first)]:
            label = f"colocated@{chunk}" if name == "colocated" else name
            arms[label], samples[label] = run_arm(name, chunk, args, w, slo, log_dir, (redis.pid, url), key)
    finally:
        stop_proc(redis)
    same_chunk = f"colocated@{args.prefill_chunk[0]}"
    out = summary(arms, greedy_compare(samples[same_chunk], samples["disagg"]), args, w, slo)
    out.update(wall_s=round(time.monotonic() - started, 1), logs=str(log_dir))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Disaggregated prefill vs colocated: ITL, throughput, SLO goodput")
    a, slo = ap.add_argument, Slo()
    a("--model", default="default")
    a("--dtype", default="auto", help="the workers' dtype (auto: the serving dtype; float32: greedy "
      "outputs compare exactly across arms)")
    a("--quantization", default="auto", help="the workers' --quantization (auto: the serving default)")
    a("--kv-dtype", default="auto", help="the workers' --kv-dtype (auto: the serving default)")
    a("--duration", type=float, default=180.0, help="seconds of load per arm, then in-flight requests drain")
    a("--drain-timeout", type=float, default=300.0, help="bound of the drain after the window")
    a("--seed", type=int, default=0)
    a("--streams", type=int, default=6,
      help="steady streams (64-128-token prompts), each restarting when done")
    a("--short-min-tokens", type=int, default=96,
      help="a steady stream's max_tokens: uniform per turn in min..max")
    a("--short-max-tokens", type=int, default=160)
    a("--long-gap", type=float, default=15.0, help="mean seconds between long prompts (Poisson)")
    a("--long-min", type=int, default=2048)
    a("--long-max", type=int, default=4096)
    a("--long-max-tokens", type=int, default=32)
    a("--kv-cache-mib", type=int, default=2048, help="each worker's KV cache")
    a("--disagg-min-tokens", type=int, default=512, help="the gateway's flag (its default)")
    a("--disagg-max-prefill-queue", type=int, default=4, help="the gateway's flag (its default)")
    a("--prefill-chunk", type=chunk_list, default=[1024, 256, 128],
      help="comma list of the workers' --max-num-batched-tokens: the colocated arm runs at each, the "
      "disaggregated one at the first")
    a("--stall-s", type=float, default=None, help="the workers' --disagg-stall-s (default: theirs, 5 s)")
    a("--slo-ttft-short", type=float, default=slo.ttft_short_s,
      help="TTFT SLO of the steady streams' requests (s)")
    a("--slo-ttft-long-base", type=float, default=slo.ttft_long_base_s,
      help="long prompts' TTFT SLO: base (s)")
    a("--slo-ttft-long-per-token", type=float, default=slo.ttft_long_per_token_s,
      help="long prompts' TTFT SLO: seconds per prompt token on top of the base")
    a("--slo-itl-p99", type=float, default=slo.itl_p99_s, help="per-request p99 inter-chunk gap SLO (s)")
    a("--ready-timeout", type=float, default=300.0)
    a("--json", action="store_true", help="(the output is always one JSON line)")
    add_no_targets(ap)
    args = ap.parse_args(argv)
    out = run(args)
    print(json.dumps(out))
    return exit_code(out, not args.no_targets)


def chunk_list(text: str) -> list[int]:
    chunks = [int(c) for c in text.split(",") if c.strip()]
    if not chunks or min(chunks) < 1:
        raise argparse.ArgumentTypeError("a comma list of positive token counts")
    return chunks


if __name__ == "__main__":
    raise SystemExit(main())
