"""`switchyard bench`: workloads, summary numbers, argument errors, a
dead server, and a run against the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.cli import main
from config.loadtest.loadgen import RequestRecord, api_base, build_workload
from config.loadtest.report import PLOT_FILES, itl_samples, summarize, throughput_series
from tests import gateway_stack
from tests.conftest import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_bench_output(out: Path, n: int) -> dict:
    """The acceptance checks on a bench output directory; returns result.json."""
    for name in ("result.json", "samples.json", "report.md", *PLOT_FILES):
        assert (out / name).is_file(), f"{name} missing"
    for name in PLOT_FILES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, f"{name} is not a PNG"
    result = json.loads((out / "result.json").read_text())
    records = json.loads((out / "samples.json").read_text())["records"]
    assert result["n"] == n == len(records)
    assert result["completed"] + sum(result["errors"].values()) == n
    assert result["completed"] == sum(r["error"] is None for r in records)
    assert result["failed"] == sum(result["errors"].values())
    ok = [r for r in records if r["error"] is None]
    assert result["total_output_tokens"] == sum(r["completion_tokens"] for r in ok)
    duration = result["duration_s"]
    assert duration >= max((r["start"] + r["e2e"] for r in records), default=0) - 1e-3
    assert result["output_tokens_per_s"] == pytest.approx(result["total_output_tokens"] / duration, rel=1e-3)
    assert result["requests_per_s"] == pytest.approx(result["completed"] / duration, rel=1e-3)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = result[key]
        if result["completed"]:
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], f"{key} percentiles out of order"
    assert all(r["ttft"] <= r["chunk_times"][-1] <= r["e2e"] for r in ok if r["ttft"] is not None)
    report = (out / "report.md").read_text()
    assert "| completed |" in report and all(f"]({name})" in report for name in PLOT_FILES)
    return result


def test_workloads_are_seeded_and_shaped() -> None:
    mixed = build_workload("mixed", 40, seed=3, max_tokens=64)
    assert mixed == build_workload("mixed", 40, seed=3, max_tokens=64)
    assert mixed != build_workload("mixed", 40, seed=4, max_tokens=64)
    assert [s.index for s in mixed] == list(range(40))
    assert all(8 <= s.max_tokens <= 64 for s in mixed)
    lengths = {len(s.messages[0]["content"].split()) for s in mixed}
    assert len(lengths) > 10 and max(lengths) > 50 and min(lengths) < 20  # really mixed

    single = build_workload("single", 5, seed=1, max_tokens=16)
    assert len({s.messages[0]["content"] for s in single}) == 1 and all(s.max_tokens == 16 for s in single)

    prefix = build_workload("prefix", 30, seed=1, prefix_count=3, prompt_words=200)
    systems = {s.messages[0]["content"] for s in prefix}
    assert all(s.messages[0]["role"] == "system" for s in prefix)
    assert 1 < len(systems) <= 3 and all(len(t.split()) >= 200 for t in systems)
    assert len({s.messages[1]["content"] for s in prefix}) == 30  # every question distinct


def test_bad_workload_and_url_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("bursty", 3)
    with pytest.raises(ValueError):
        build_workload("single", 0)
    with pytest.raises(ValueError, match="prompt_words"):
        build_workload("mixed", 3, prompt_words=2)
    assert max(len(s.messages[0]["content"].split())
               for s in build_workload("mixed", 50, prompt_words=30)) <= 33
    with pytest.raises(ValueError, match="http"):
        api_base("localhost:8000")
    assert api_base("http://h:1/") == api_base("http://h:1/v1") == "http://h:1/v1"


def test_summary_numbers() -> None:
    records = [
        RequestRecord(index=i, start=0.1 * i, status=200, ttft=0.1 * (i + 1), e2e=0.1 * (i + 1) + 0.4,
                      chunk_times=[0.1 * (i + 1) + 0.1 * k for k in range(5)], completion_tokens=5,
                      prompt_tokens=20, cached_tokens=10, usage_reported=True)
        for i in range(10)
    ]
    records.append(RequestRecord(index=10, start=0.0, status=429, error="429", e2e=0.01))
    records.append(RequestRecord(index=11, start=0.0, error="timeout", e2e=5.0))
    s = summarize(records, duration_s=2.0, meta={"workload": "single"})
    assert (s["n"], s["completed"], s["failed"]) == (12, 10, 2)
    assert s["errors"] == {"429": 1, "timeout": 1}
    assert s["total_output_tokens"] == 50 and s["output_tokens_per_s"] == 25.0
    assert s["requests_per_s"] == 5.0 and s["cached_fraction"] == 0.5
    slow = summarize(records, duration_s=273.7, meta={})  # small rates keep their relative precision
    assert slow["requests_per_s"] == pytest.approx(10 / 273.7, rel=1e-5)
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)  # ttft 100..1000 ms
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and itl_samples(records).size == 40
    assert s["e2e_ms"]["p99"] == pytest.approx(1391.0)  # failed requests' e2e excluded
    starts, rates = throughput_series(records, bin_s=0.5)
    assert float((rates * 0.5).sum()) == pytest.approx(50.0)  # the timeline integrates to the token total


def _bench(*args: str) -> int:
    return main(["bench", "--no-progress", *args])


def test_bad_arguments_exit_2_and_write_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ["--url", "http://127.0.0.1:9", "--key", "k", "--out", str(out)]
    assert _bench(*base, "--n", "0") == 2
    assert _bench(*base, "--concurrency", "0") == 2
    assert _bench(*base, "--compare", str(tmp_path / "nothing-here")) == 2
    assert _bench("--url", "127.0.0.1:9", "--key", "k", "--out", str(out)) == 2
    with pytest.raises(SystemExit):
        _bench(*base, "--workload", "bursty")
    assert not out.exists()


def test_dead_server_counts_every_request_as_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert _bench("--url", url, "--key", "k", "--out", str(tmp_path / "m"), "--n", "1") == 1
    assert "models" in capsys.readouterr().err  # model discovery failed: said so, wrote nothing
    assert not (tmp_path / "m").exists()

    out = tmp_path / "dead"
    code = _bench("--url", url, "--key", "k", "--model", "m", "--out", str(out), "--n", "5",
                  "--concurrency", "2", "--workload", "single", "--timeout", "5")
    assert code == 1
    result = check_bench_output(out, 5)
    assert result["completed"] == 0 and result["errors"] == {"transport": 5}
    assert result["ttft_ms"]["p50"] is None

    again = ["--url", url, "--key", "k", "--model", "m", "--n", "2", "--workload", "single", "--timeout", "5"]
    assert _bench(*again, "--out", str(tmp_path / "again"), "--compare", str(out)) == 1
    assert "| metric | again | dead |" in (tmp_path / "again" / "report.md").read_text()
    (out / "samples.json").unlink()
    capsys.readouterr()
    assert _bench(*again, "--out", str(tmp_path / "third"), "--compare", str(out)) == 1
    assert "report failed" in capsys.readouterr().err
    assert (tmp_path / "third" / "result.json").is_file()  # the run's own numbers are kept


def test_bench_against_the_gateway_and_compare(stack: gateway_stack.GatewayStack, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    first, second = tmp_path / "mixed", tmp_path / "prefix"
    # small prompts: the CPU worker is shared with the other tests on two cores
    common = ["--url", stack.base_url, "--key", stack.key, "--max-tokens", "8", "--timeout", "120"]
    assert _bench(*common, "--workload", "mixed", "--prompt-words", "60", "--n", "4", "--concurrency", "2",
                  "--out", str(first)) == 0
    result = check_bench_output(first, 4)
    assert result["completed"] == 4 and result["errors"] == {}, result["error_examples"]
    assert result["usage_reported"] == 4  # token counts came from the gateway's usage chunks
    samples = json.loads((first / "samples.json").read_text())["records"]
    specs = build_workload("mixed", 4, seed=0, max_tokens=8, prompt_words=60)
    for record, spec in zip(samples, specs, strict=True):
        assert 1 <= record["completion_tokens"] <= spec.max_tokens
        assert record["prompt_tokens"] > len(spec.messages[0]["content"].split()) // 2
        assert record["status"] == 200 and record["ttft"] <= record["e2e"]
    assert result["model"] and str(first / "result.json") in capsys.readouterr().out

    assert _bench(*common, "--workload", "prefix", "--prompt-words", "80", "--n", "3", "--concurrency", "2",
                  "--out", str(second), "--compare", str(first)) == 0
    other = check_bench_output(second, 3)
    assert other["completed"] == 3 and other["total_prompt_tokens"] > 3 * 80  # long shared system prompts
    report = (second / "report.md").read_text()
    assert "| metric | prefix | mixed |" in report  # both runs tabulated side by side

    bad = tmp_path / "badkey"
    assert _bench(*common[:2], "--key", "sk-not-a-key", "--model", "default", "--n", "3",
                  "--workload", "single", "--out", str(bad)) == 1
    assert check_bench_output(bad, 3)["errors"] == {"401": 3}
