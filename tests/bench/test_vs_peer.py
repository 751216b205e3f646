"""`bench/vs_peer.py` without a peer: argument checks, alternation
of the sides, the JSON line and its ratios."""

from __future__ import annotations

import json

import pytest

from bench import vs_peer


@pytest.fixture(autouse=True)
def loadgen(tmp_path, monkeypatch):
    """A stand-in path: the tests never run the real load generator."""
    path = tmp_path / "loadgen.py"
    path.write_text("")
    monkeypatch.setattr(vs_peer, "LOADGEN", path)


def fake_load(url: str, workload: str) -> dict:
    ours = url == "ours"
    return {"mixed": {"out_tok_s": 130.0 if ours else 100.0},
            "prefix": {"ttft_p50_ms": 400.0 if ours else 1000.0},
            "single": {"tpot_p50_ms": 30.0 if ours else 40.0, "ttft_p50_ms": 50.0 if ours else 50.0},
            "long": {"out_tok_s": 90.0 if ours else 60.0},
            "nmixed": {"out_tok_s": 120.0 if ours else 100.0},
            "nprefix": {"ttft_p50_ms": 500.0 if ours else 1000.0},
            "nsingle": {"tpot_p50_ms": 20.0 if ours else 40.0, "ttft_p50_ms": 60.0 if ours else 50.0},
            }[workload] | {"workload": workload}


def test_alternates_sides_and_prints_median_ratios(monkeypatch, capsys):
    events: list[str] = []
    up: set[str] = set()

    def side(name: str):
        def start() -> vs_peer.Server:
            assert not up, f"{name} started while {up} is running"
            up.add(name)
            events.append(f"start {name}")

            def stop() -> None:
                up.discard(name)
                events.append(f"stop {name}")
            return vs_peer.Server(name, "k", "m", stop)
        return start

    def run_workload(server, workload, n, concurrency, args):
        assert server.url in up
        assert (n, concurrency) == vs_peer.QUICK[workload]
        return fake_load(server.url, workload)

    monkeypatch.setattr(vs_peer, "run_workload", run_workload)
    args = vs_peer.parse(["--quick", "--quantization", "none", "--dtype", "float32"])
    result = vs_peer.compare(args, side("ours"), side("peer"))
    assert events == ["start ours", "stop ours", "start peer", "stop peer"] * 2
    line = json.loads(json.dumps(result))
    assert line["ratios"] == {"mixed_out_tok_s": 1.3, "prefix_ttft_p50": 0.4, "single_tpot_p50": 0.75,
                              "single_ttft_p50": 1.0, "long_out_tok_s": 1.5, "natural_mixed_out_tok_s": 1.2,
                              "natural_prefix_ttft_p50": 0.5, "natural_single_tpot_p50": 0.5,
                              "natural_single_ttft_p50": 1.2}
    assert len(line["passes"]) == 2 and set(line["passes"][0]) == {"ours", "peer"}
    assert line["ours"]["dtype"] == "float32" and line["ours"]["quantization"] == "none"
    assert line["cpu"] and line["sizes"]["mixed"] == {"n": 8, "concurrency": 4}


def test_side_stops_when_load_fails(monkeypatch):
    stopped = []

    def boom(*a, **k):
        raise RuntimeError("loadgen failed")

    monkeypatch.setattr(vs_peer, "run_workload", boom)
    with pytest.raises(RuntimeError):
        vs_peer.run_side(lambda: vs_peer.Server("u", "", "m", lambda: stopped.append(1)), vs_peer.QUICK,
                         vs_peer.parse([]))
    assert stopped == [1]


def test_ratios_median_and_missing_figures():
    def p(ours: float | None, peer: float | None) -> dict:
        return {"ours": {"mixed": {"out_tok_s": ours}, "prefix": {}, "single": {"tpot_p50_ms": float("nan")}},
                "peer": {"mixed": {"out_tok_s": peer}, "prefix": {}, "single": {"tpot_p50_ms": 10.0}}}

    r = vs_peer.ratios([p(1.0, 2.0), p(3.0, 2.0), p(2.0, None)])
    # the median of 0.5 and 1.5; a pass without the peer's figure is left out
    assert r["mixed_out_tok_s"] == 1.0
    # no figure, or no such workload run
    assert all(v is None for k, v in r.items() if k != "mixed_out_tok_s")


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
    args = vs_peer.parse(["--peer-url", f"http://127.0.0.1:{free_port()}", "--peer-ready-timeout", "0.5",
                          "--peer-start", "true", "--peer-stop", f"touch {marker}"])
    with pytest.raises(TimeoutError):
        vs_peer.start_peer(args)
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
        out = subprocess.run([sys.executable, str(vs_peer.LONG_LOADGEN), str(fake), "--workload", workload,
                              "--n", "3"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    got = run("long")
    assert all(1600 <= w <= 2400 for w in got["words"]) and got["out"] == [256] * 3
    assert run("mixed") == {"words": [1] * 3, "out": [1] * 3}  # the others are the shared generator's own
    nat = run("nprefix")
    # a long shared passage, then a question
    assert all(w > 1400 for w in nat["words"]) and nat["out"] == [24] * 3


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
        vs_peer.run_workload(vs_peer.Server("u", "k", "m", lambda: None), "mixed", 8, 2, vs_peer.parse([]))


def test_workloads_and_worker_args_narrow_the_run(monkeypatch):
    seen = []
    monkeypatch.setattr(vs_peer, "run_workload",
                        lambda server, w, n, c, args: seen.append(w) or fake_load(server.url, w))
    args = vs_peer.parse(["--quick", "--workloads", "single", "--worker-args", "--spec-tokens 0",
                          "--passes", "1"])
    result = vs_peer.compare(args, lambda: vs_peer.Server("ours", "k", "m", lambda: None),
                             lambda: vs_peer.Server("peer", "k", "m", lambda: None))
    assert seen == ["single", "single"] and set(result["sizes"]) == {"single"}
    assert result["ours"]["worker_args"] == "--spec-tokens 0" and result["ratios"]["single_tpot_p50"] == 0.75
