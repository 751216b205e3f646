"""KV tiers benchmark: T tenants, each with its own ~1,000-token system prompt, a working set of at least 4x
the KV pool, requests in random tenant order; tiers off vs on (host RAM at its auto size) in one process,
alternating.

Targets on CPU: `ttft_p50_ratio` (on / off) <= 0.35, `cached_frac_on` >= 0.8 (--json for one line); exits 1
when one is missed (`--no-targets`: 0, for small configurations).

`--disk`: the tiers-on side restores from a disk tier instead: its host RAM tier is smaller than one page
(every page the pool evicts passes through it to disk), the disk tier lives in a fresh directory under
`--disk-dir` (the system's temporary directory by default; removed after the run) and every page leaving RAM
is written (`--disk-min-hits 0`). Before each request of that side the writer's queue is drained and, unless
`--keep-page-cache`, the tier's files are synced and dropped from the OS page cache, so restores read the
device. The JSON line then also carries `disk_*` fields: pages and MB written and read, the writer thread's
and the reads' MB/s, per-page read times, per-request restore times.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.machine import add_no_targets, cpu_model, emit, machine_fields
from bench.prefix_cache import CITIES, TOPICS, system_prompt
from worker.config import EngineConfig
from worker.engine.core import Engine
from worker.kvcache.tensors import bytes_per_page
from worker.kvcache.tiers.disk import HEADER, SUFFIX, DiskTier
from worker.kvcache.tiers.tier_store import KvTiers
from worker.model.kv_dtype import resolve_kv_dtype
from worker.model.loader import LoadedModel, load_any
from worker.protocol import SamplingParams

TARGETS = {"ttft_p50_ratio": 0.35, "cached_frac_on": 0.8}
COMPANIES = ("Northwind", "Contoso", "Fabrikam", "Tailspin", "Wingtip", "Litware", "Adatum", "Proseware",
             "Lucerne", "Margie's", "Woodgrove", "Alpine", "Coho", "Fourth Coffee", "Humongous", "Trey")
# --disk: a host RAM tier smaller than one page holds nothing (0 would turn the tiers off)
DISK_HOST_BYTES = 1
MB = 1e6


def tenant_prompts(loaded: LoadedModel, tenants: int, system_tokens: int) -> list[list[int]]:
    """One system prompt per tenant (its own company and rule order), as chat-template token ids."""
    tok = loaded.tokenizer
    base = system_prompt(tok, system_tokens)
    out = []
    for t in range(tenants):
        rules = base.split(". ")
        random.Random(t).shuffle(rules)
        out.append(f"You work for {COMPANIES[t % len(COMPANIES)]} (desk {t}). " + ". ".join(rules))
    return [tok.apply_chat_template([{"role": "system", "content": s}]) for s in out]


def question(tok, i: int) -> list[int]:
    text = f"Hi, order {1000 + i} to {CITIES[i % len(CITIES)]}: what about {TOPICS[(i * 7) % len(TOPICS)]}?"
    return tok.encode(text, add_special_tokens=False)


def fs_type(path: str | Path) -> str:
    """The file system type /proc/mounts gives for the mount holding `path` ("unknown" when unreadable)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) and \
                    len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


class DiskProbe:
    """Times the disk tier of one engine: its writer thread's file writes and every
    page file read (both wrapped on the instance), and drains and uncaches the tier
    before each request (outside the timed window)."""

    def __init__(self, tiers: KvTiers, drop_cache: bool) -> None:
        assert tiers.disk is not None
        self.tiers, self.disk, self.drop_cache = tiers, tiers.disk, drop_cache
        self.lock = threading.Lock()
        self.write_bytes = self.read_bytes = 0
        self.write_s = 0.0
        self.reads_s: list[float] = []  # per page read from a file
        self.restores_s: list[float] = []  # per timed request that restored
        self._load_before = 0.0
        disk = self.disk
        write, load = disk._write, disk.load

        def timed_write(key: bytes, data: torch.Tensor) -> None:  # the writer thread only
            before, t = disk.writes, time.perf_counter()
            write(key, data)
            if disk.writes > before:  # a file was written (not already there, nor refused)
                self.write_s += time.perf_counter() - t
                self.write_bytes += data.numel() + HEADER.size

        def timed_load(key: bytes) -> torch.Tensor | None:
            t = time.perf_counter()
            data = load(key)
            if data is not None:
                with self.lock:
                    self.reads_s.append(time.perf_counter() - t)
                    self.read_bytes += data.numel() + HEADER.size
            return data

        disk._write, disk.load = timed_write, timed_load  # type: ignore[method-assign]

    def before(self) -> None:
        """Untimed: wait for queued writes (so reads come from files),
        then drop the files from the page cache."""
        self.disk.flush()
        if self.drop_cache:
            drop_page_cache(self.disk)
        self._load_before = self.tiers.stats.load_seconds

    def after(self) -> None:
        grown = self.tiers.stats.load_seconds - self._load_before
        if grown > 0:
            self.restores_s.append(grown)

    def fields(self, dir_: str) -> dict:
        self.disk.flush()
        st, disk = self.tiers.snapshot_stats(), self.disk
        with self.lock:
            reads, read_bytes = sorted(self.reads_s), self.read_bytes

        def ms(xs: list[float], q: float) -> float | None:
            return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

        def rate(n: int, s: float) -> float | None:
            return round(n / MB / s, 1) if s > 0 else None

        restores = sorted(self.restores_s)
        return {
            "disk_mode": True, "disk_fs": fs_type(dir_),
            "disk_page_cache": "dropped" if self.drop_cache else "kept",
            "disk_min_hits": self.tiers.disk_min_hits, "disk_capacity_mb": round(disk.capacity_bytes / MB, 1),
            "disk_writes": st.disk_writes, "disk_write_mb": round(self.write_bytes / MB, 2),
            "disk_write_mb_s": rate(self.write_bytes, self.write_s), "disk_dropped": st.disk_dropped,
            "disk_hits": st.disk_hits, "ram_hits": st.ram_hits, "disk_reads": len(reads),
            "disk_read_mb": round(read_bytes / MB, 2), "disk_read_mb_s": rate(read_bytes, sum(reads)),
            "disk_read_ms_p50": ms(reads, 0.5), "disk_read_ms_p99": ms(reads, 0.99),
            "disk_corrupt": st.disk_corrupt, "disk_evictions": st.disk_evictions,
            "disk_tier_mb": round(st.disk_bytes / MB, 2),
            "restore_mb_s": rate(st.restored_bytes, st.load_seconds), "restores": len(restores),
            "restore_ms_p50": ms(restores, 0.5), "restore_ms_p99": ms(restores, 0.99),
        }


def drop_page_cache(disk: DiskTier) -> None:
    """Sync each page file and ask the kernel to drop its cached pages (no effect on tmpfs)."""
    for path in disk.dir.glob(f"*/*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class Side:
    """One engine (tiers off or on) with its TTFTs and cached share; requests run one at a time. With
    `disk_dir` the tiers-on engine restores from a disk tier there (host RAM tier below one page)."""

    def __init__(self, loaded: LoadedModel, systems: list[list[int]], args: argparse.Namespace, tiers: bool,
                 pages: int, kv_dtype: str, disk_dir: str | None = None) -> None:
        per_page = bytes_per_page(loaded.config, loaded.dtype, args.block_size, kv_dtype)
        disk = tiers and disk_dir is not None
        tier_config = dict(kv_host_bytes=DISK_HOST_BYTES, kv_disk_dir=disk_dir, kv_disk_bytes=args.disk_bytes,
                           kv_disk_min_hits=args.disk_min_hits) if disk \
            else dict(kv_host_bytes=None if tiers else 0)
        self.engine = Engine(loaded, EngineConfig(kv_cache_bytes=pages * per_page, kv_dtype=kv_dtype,
                                                  block_size=args.block_size, **tier_config))
        self.probe = DiskProbe(self.engine.restorer.tiers, not args.keep_page_cache) \
            if disk and self.engine.restorer is not None else None
        self.disk_dir = disk_dir
        self.systems, self.tok = systems, loaded.tokenizer
        self.params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
        self.ttft: list[float] = []
        self.cached = self.prompt = 0

    def one(self, rid: str, tenant: int, i: int, timed: bool = True) -> None:
        engine, prompt = self.engine, self.systems[tenant] + question(self.tok, i)
        if self.probe is not None:
            self.probe.before()
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, self.params, namespace=b"tenant-%d" % tenant)
        ttft, cached = None, 0
        while engine.has_work():
            for out in engine.step():
                if ttft is None and out.new_tokens:
                    ttft, cached = time.perf_counter() - t0, out.cached_tokens
        assert ttft is not None
        if self.probe is not None and timed:
            self.probe.after()
        if timed:
            self.ttft.append(ttft)
            self.cached += cached
            self.prompt += len(prompt)

    def result(self) -> dict:
        st = self.engine.stats()
        disk = self.probe.fields(self.disk_dir) if self.probe is not None and self.disk_dir else None
        self.engine.close()
        ts = st.tiers
        return {"disk": disk, "ttft": self.ttft, "cached_frac": self.cached / self.prompt,
                "pool_tokens": st.kv_total_tokens,
                "restored_tokens": ts.restored_tokens if ts else 0,
                "host_mb": round(ts.ram_bytes / 2**20, 1) if ts else 0,
                "skipped_by_cost": ts.skipped_by_cost if ts else 0,
                "restore_ms_per_1k": round(1e6 * ts.load_seconds / ts.restored_tokens, 2)
                if ts and ts.restored_tokens else None}


def run(loaded: LoadedModel, systems: list[list[int]], order: list[int], args: argparse.Namespace, pages: int,
        kv_dtype: str, disk_dir: str | None = None) -> dict[bool, dict]:
    """Both engines warm each tenant once (untimed); then each timed request runs on both, the one going first
    alternating, so a load change on a shared machine falls on both sides alike. `disk_dir`: the tiers-on side
    restores from a disk tier there."""
    sides = {tiers: Side(loaded, systems, args, tiers, pages, kv_dtype, disk_dir) for tiers in (False, True)}
    for side in sides.values():
        for t in range(len(systems)):
            side.one(f"warm{t}", t, 10_000 + t, timed=False)
    for i, t in enumerate(order):
        for tiers in ((False, True) if i % 2 == 0 else (True, False)):
            sides[tiers].one(f"q{i}", t, i)
    return {tiers: side.result() for tiers, side in sides.items()}


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[-1] if len(xs) > 1 else xs[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    add_no_targets(ap)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--pool-factor", type=float, default=5.0, help="working set / KV pool (>= 4)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="auto", help="auto | model | int8")
    ap.add_argument("--dtype", default="auto", help="auto (the worker's choice) | bfloat16 | float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default", help="default | tiny-random (tests) | a local model folder")
    ap.add_argument("--disk", action="store_true",
                    help="the tiers-on side restores from a disk tier (host RAM tier below one page)")
    ap.add_argument("--disk-dir", default=None,
                    help="--disk: where the disk tier's fresh directory goes (removed after the run; "
                         "default: the system's temporary directory); put it on the device to measure")
    ap.add_argument("--disk-bytes", type=int, default=16 << 30, help="--disk: the disk tier's bound in bytes")
    ap.add_argument("--disk-min-hits", type=int, default=0,
                    help="--disk: hits a page needs before it goes to disk (0: every page leaving RAM)")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="--disk: leave the tier's files in the OS page cache between requests")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    loaded = load_any(args.model, dtype=args.dtype, device="cpu")
    kv_dtype = resolve_kv_dtype(EngineConfig(kv_dtype=args.kv_dtype), loaded.device)[0]
    systems = tenant_prompts(loaded, args.tenants, args.system_tokens)
    working_set = sum(len(s) for s in systems)
    pages = int(working_set / args.pool_factor) // args.block_size
    rng = random.Random(args.seed)
    order = [rng.randrange(args.tenants) for _ in range(args.requests)]
    # a fresh directory: page files an earlier run left (same
    # fingerprint) would be indexed and hit from the start
    disk_dir = tempfile.mkdtemp(prefix="kv-tiers-bench-", dir=args.disk_dir) if args.disk else None
    if disk_dir is not None and fs_type(disk_dir) == "tmpfs":
        print(f"warning: {disk_dir} is on tmpfs (RAM): pass --disk-dir on the device to measure",
              file=sys.stderr)
    try:
        res = run(loaded, systems, order, args, pages, kv_dtype, disk_dir)
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    for tiers in (False, True):
        print(f"tiers {'on' if tiers else 'off'}: "
              f"ttft p50 {statistics.median(res[tiers]['ttft']) * 1e3:.1f} ms, "
              f"cached {res[tiers]['cached_frac']:.3f}", file=sys.stderr, flush=True)
    off, on = res[False], res[True]
    assert working_set >= 4 * on["pool_tokens"], "the working set must be at least 4x the KV pool"
    result = {
        "ttft_p50_ratio": round(statistics.median(on["ttft"]) / statistics.median(off["ttft"]), 4),
        "ttft_p99_ratio": round(p99(on["ttft"]) / p99(off["ttft"]), 4),
        "cached_frac_on": round(on["cached_frac"], 4), "cached_frac_off": round(off["cached_frac"], 4),
        "ttft_p50_on_ms": round(statistics.median(on["ttft"]) * 1e3, 1),
        "ttft_p50_off_ms": round(statistics.median(off["ttft"]) * 1e3, 1),
        "ttft_p99_on_ms": round(p99(on["ttft"]) * 1e3, 1),
        "ttft_p99_off_ms": round(p99(off["ttft"]) * 1e3, 1),
        "restored_tokens": on["restored_tokens"], "restore_ms_per_1k_tokens": on["restore_ms_per_1k"],
        "skipped_by_cost": on["skipped_by_cost"], "host_tier_mb": on["host_mb"],
        "pool_tokens": on["pool_tokens"], "working_set_tokens": working_set,
        "working_set_over_pool": round(working_set / on["pool_tokens"], 2),
        "tenants": args.tenants, "requests": args.requests, "warmup_per_tenant": 1,
        "output_tokens": args.output_tokens,
        "cpu": cpu_model(), "dtype": str(loaded.dtype).replace("torch.", ""), "kv_dtype": kv_dtype,
        "threads": torch.get_num_threads(), **machine_fields(load_before),
    }
    if on["disk"] is not None:
        result.update(on["disk"])
    result["targets_met"] = result["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"] and \
        result["cached_frac_on"] >= TARGETS["cached_frac_on"]
    return emit(result, args.json, not args.no_targets)


if __name__ == "__main__":
    sys.exit(main())
