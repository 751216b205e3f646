"""`bench/vs_peer.py` without a peer: argument checks, the order of the sides, the trace workload, the
JSON line's ratios per comparison, its targets and exit code."""

from __future__ import annotations

import json

import pytest

from bench import peer_sides, vs_peer


@pytest.fixture(autouse=True)
def loadgen(tmp_path, monkeypatch):
    """A stand-in path: the tests never run the real load generator."""
    path = tmp_path / "loadgen.py"
    path.write_text("")
    monkeypatch.setattr(vs_peer, "LOADGEN", path)


def fake_load(label: str, workload: str) -> dict:
    """Figures by side: ours' matched is 1.4x the peer's throughput, best 2x; latencies to suit."""
    scale = {"matched": 1.4, "best": 2.0, "best_nospec": 2.0, "peer": 1.0}[label]
    return {"ntrace": {"out_tok_s": 100.0 * scale, "ok": 8, "wall_s": 4.0},
            "nprefix": {"ttft_p50_ms": 1000.0 / (2 * scale) if label != "peer" else 1000.0},
            "nsingle": {"tpot_p50_ms": 40.0 / scale if label != "best_nospec" else 25.0,
                        "ttft_p50_ms": 50.0},
            "mixed": {"out_tok_s": 100.0 * scale}}[workload] | {"workload": workload,
                                                                 "prompts_sha256": "ab" * 32}


class Sides:
    """Stand-ins for both systems: records starts and stops, refuses two up at once."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.up: set[str] = set()

    def start(self, config: peer_sides.Config) -> peer_sides.Server:
        assert not self.up, f"{config.label} started while {self.up} is running"
        self.up.add(config.label)
        self.events.append(f"start {config.label}")

        def stop() -> None:
            self.up.discard(config.label)
            self.events.append(f"stop {config.label}")
        return peer_sides.Server(config.label, "k", "m", stop,
                                 metrics_url=None if config.system == "peer" else config.label)


@pytest.fixture
def fake_runs(monkeypatch):
    """run_workload, run_open_loop and spec_counters without processes; returns the open-loop calls."""
    opened: list[tuple[str, list[float]]] = []

    def run_workload(server, workload, n, concurrency, *rest, seed=1):
        if seed == vs_peer.WARM_SEED:  # each side's uncounted warm-up, on prompts no workload sends
            opened.append((server.url, "warm"))
            return {}
        assert (n, concurrency) == vs_peer.QUICK[workload] and seed == 1
        assert opened and opened[-1] == (server.url, "warm")
        return fake_load(server.url, workload)

    def run_open_loop(server, workload, rates, n, *rest):
        opened.append((server.url, rates))
        assert n == vs_peer.QUICK["ntrace"][0] // 2
        good = {"matched": 1.5, "best": 2.0, "peer": 1.0}[server.url]
        return {"max_goodput_rps": good, "prompts_sha256": "cd" * 32}

    monkeypatch.setattr(peer_sides, "run_workload", run_workload)
    monkeypatch.setattr(peer_sides, "run_open_loop", run_open_loop)
    monkeypatch.setattr(peer_sides, "spec_counters", lambda url: None if url is None else (100.0, 40.0))
    return opened


def test_alternates_sides_and_prints_ratios_per_comparison(fake_runs):
    sides = Sides()
    args = vs_peer.parse(["--quick", "--dtype", "float32"])
    result = vs_peer.compare(args, sides.start)
    order = ["matched", "peer", "best", "best_nospec"]
    assert sides.events == [f"{e} {s}" for s in order for e in ("start", "stop")] * 2
    m, b = result["ratios"]["matched"], result["ratios"]["best"]
    assert (m["trace_out_tok_s"], m["goodput_rps"], m["prefix_ttft_p50"]) == (1.4, 1.5, 0.357)
    assert (b["trace_out_tok_s"], b["goodput_rps"], m["single_tpot_p50"]) == (2.0, 2.0, 0.714)
    # speculation: best (20 ms) against best without it (25 ms)
    assert result["speculation"] == {"single_tpot_on_over_off": 0.8, "acceptance_rate": 0.4}
    assert result["configs"]["matched"]["dtype"] == result["configs"]["peer"]["dtype"] == "float32"
    assert result["configs"]["best"]["quantization"] == "w8a8" and result["configs"]["best"]["speculation"]
    # open loop at fractions of the first side's closed-loop capacity (8 requests in 4 s), never for nospec
    opened = [(u, r) for u, r in fake_runs if r != "warm"]
    assert [u for u, _ in opened] == ["matched", "peer", "best"] * 2
    assert all(r == [1.0, 2.0, 3.0] for _, r in opened)
    assert [u for u, r in fake_runs if r == "warm"] == order * 2
    assert result["targets_met"] == {"matched.trace_out_tok_s": True, "matched.goodput_rps": True,
                                     "matched.prefix_ttft_p50": True, "matched.single_tpot_p50": True,
                                     "matched.single_ttft_p50": True, "best.trace_out_tok_s": True,
                                     "best.goodput_rps": True, "best.prefix_ttft_p50": True,
                                     "speculation_never_worse": True}


def test_a_missed_target_exits_one(fake_runs, monkeypatch, capsys):
    monkeypatch.setattr(vs_peer, "FULL", vs_peer.QUICK)
    sides = Sides()

    def start(config, *rest):
        return sides.start(config)

    monkeypatch.setattr(peer_sides, "start_ours", start)
    monkeypatch.setattr(peer_sides, "start_peer", start)
    monkeypatch.setattr(vs_peer, "TARGETS", {"matched": {"trace_out_tok_s": (">=", 1.5)}})
    assert vs_peer.main(["--compare", "matched", "--passes", "1", "--open-loop", ""]) == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["targets_met"] == {"matched.trace_out_tok_s": False} and "best" not in line["configs"]
    assert vs_peer.main(["--compare", "matched", "--passes", "1", "--open-loop", "", "--no-targets"]) == 0


def test_prompts_that_differ_between_sides_fail_the_run(fake_runs, monkeypatch):
    def run_workload(server, workload, *rest, seed=1):
        if seed == vs_peer.WARM_SEED:
            return {}
        return fake_load(server.url, workload) | {"prompts_sha256": server.url}

    monkeypatch.setattr(peer_sides, "run_workload", run_workload)
    with pytest.raises(RuntimeError, match="prompts differ"):
        vs_peer.compare(vs_peer.parse(["--quick", "--passes", "1", "--compare", "matched"]), Sides().start)


def test_side_stops_when_load_fails(monkeypatch):
    stopped = []

    def boom(*a, **k):
        raise RuntimeError("loadgen failed")

    monkeypatch.setattr(peer_sides, "run_workload", boom)
    config = vs_peer.configs(vs_peer.parse([]))[0]
    with pytest.raises(RuntimeError):
        vs_peer.run_side(lambda c: peer_sides.Server("u", "", "m", lambda: stopped.append(1)), config,
                         vs_peer.parse(["--quick"]), [])
    assert stopped == [1]


def test_ratios_median_and_missing_figures():
    def p(ours: float | None, peer: float | None) -> dict:
        return {"matched": {"ntrace": {"out_tok_s": ours}, "nprefix": {},
                            "nsingle": {"tpot_p50_ms": float("nan")}},
                "peer": {"ntrace": {"out_tok_s": peer}, "nprefix": {}, "nsingle": {"tpot_p50_ms": 10.0}}}

    r = vs_peer.ratios([p(1.0, 2.0), p(3.0, 2.0), p(2.0, None)], "matched")
    # the median of 0.5 and 1.5; a pass without the peer's figure is left out
    assert r["trace_out_tok_s"] == 1.0
    # no figure, or no such workload run
    assert all(v is None for k, v in r.items() if k != "trace_out_tok_s")


def test_our_speculation_counters_come_from_the_workers_metrics(tmp_path):
    import http.server
    import threading

    body = (b"# HELP x\nswitchyard_worker_spec_proposed_tokens_total 120.0\n"
            b"switchyard_worker_spec_accepted_tokens_total 30.0\n")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.handle_request, daemon=True).start()
    try:
        assert peer_sides.spec_counters(f"http://127.0.0.1:{srv.server_port}/metrics") == (120.0, 30.0)
    finally:
        srv.server_close()
    assert peer_sides.spec_counters(None) is None


@pytest.mark.parametrize("argv, message", [
    (["--peer-start", "start.sh"], "go together"),
    (["--passes", "0"], "--passes"),
    (["--loadgen", "/nonexistent/loadgen.py"], "not found"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        vs_peer.parse(argv)
    assert message in capsys.readouterr().err


def test_peer_not_ready_is_a_timeout_and_stops_it(tmp_path):
    from config.local_stack.launcher import free_port

    marker = tmp_path / "stopped"
    config = vs_peer.configs(vs_peer.parse([]))[1]
    with pytest.raises(TimeoutError):
        peer_sides.start_peer(config, f"http://127.0.0.1:{free_port()}", "", "m", "true", f"touch {marker}",
                              0.5)
    assert marker.exists()


def test_long_workload_runs_through_the_shared_generator(tmp_path):
    """bench/long_loadgen.py adds `long` to the peers' generator:
    2-3k-token-sized prompts, 256 out, same fields."""
    import subprocess
    import sys

    fake = tmp_path / "loadgen.py"
    fake.write_text(
        "import json, random, sys\n"
        "def text(rng, n):\n    return ' '.join('w' for _ in range(n))\n"
        "def workload(name, n, seed):\n    return [('x', 1)] * n\n"
        "async def one(client, args, prompt, max_tokens, out):\n    out.append({'out': max_tokens})\n"
        "async def main():\n"
        "    n = int(sys.argv[sys.argv.index('--n') + 1])\n"
        "    reqs = workload(sys.argv[sys.argv.index('--workload') + 1], n, 1)\n"
        "    print(json.dumps({'words': [len(p.split()) for p, _ in reqs], 'out': [m for _, m in reqs]}))\n")
    def run(workload: str) -> dict:
        out = subprocess.run([sys.executable, str(peer_sides.LONG_LOADGEN), str(fake), "--workload", workload,
                              "--n", "3"], capture_output=True, text=True, check=True)
        assert "prompts_sha256 " in out.stderr
        return json.loads(out.stdout)

    got = run("long")
    assert all(1600 <= w <= 2400 for w in got["words"]) and got["out"] == [256] * 3
    assert run("mixed") == {"words": [1] * 3, "out": [1] * 3}  # the others are the shared generator's own
    nat = run("nprefix")
    # a long shared passage, then a question
    assert all(w > 1400 for w in nat["words"]) and nat["out"] == [24] * 3
    trace = run("ntrace")  # lengths from the trace sample, clipped to the 4,096-token context
    assert all(1 <= w <= 2000 for w in trace["words"]) and all(1 <= m <= 600 for m in trace["out"])
    assert len(set(trace["out"])) > 1


def test_trace_lengths_follow_the_published_trace():
    import statistics

    from bench.long_loadgen import TRACE_MAX_OUT, TRACE_MAX_PROMPT, trace_lengths

    pairs = trace_lengths()
    assert len(pairs) == 512
    # the Azure 2023 conversation trace: median 1,020 context and 129 generated tokens over all 19,366
    assert 900 <= statistics.median(c for c, _ in pairs) <= 1150
    assert 110 <= statistics.median(g for _, g in pairs) <= 150
    assert max(c for c, _ in pairs) == TRACE_MAX_PROMPT and max(g for _, g in pairs) == TRACE_MAX_OUT


def test_a_stream_short_of_its_max_tokens_is_an_error():
    import asyncio

    from bench.long_loadgen import checked

    async def one(client, args, prompt, max_tokens, out):
        out.append({"out": max_tokens - 1, "ttft": 0.1})

    out: list[dict] = []
    asyncio.run(checked(one)(None, None, "p", 8, out))
    assert out == [{"error": "short", "body": "7 of 8 tokens"}]


def test_a_failed_request_fails_the_workload(monkeypatch):
    import subprocess

    line = json.dumps({"workload": "mixed", "ok": 7, "errors": 1, "first_error": {"error": "short"}})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, line + "\n", ""))
    with pytest.raises(RuntimeError, match="1 of 8 requests failed or ended short"):
        peer_sides.run_workload(peer_sides.Server("u", "k", "m", lambda: None), "mixed", 8, 2,
                                peer_sides.LOADGEN, 60.0, 60.0)


def test_workloads_narrow_the_run(fake_runs):
    args = vs_peer.parse(["--quick", "--workloads", "nsingle", "--passes", "1", "--open-loop", ""])
    result = vs_peer.compare(args, Sides().start)
    assert {label: sorted(f) for label, f in result["passes"][0].items()} == {
        "matched": ["nsingle", "speculation"], "peer": ["nsingle"], "best": ["nsingle", "speculation"],
        "best_nospec": ["nsingle", "speculation"]}
    assert result["ratios"]["matched"]["single_tpot_p50"] == 0.714
    assert all(r == "warm" for _, r in fake_runs)  # no open loop
