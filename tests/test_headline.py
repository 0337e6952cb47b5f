"""benchmarks/headline.py without a GPU: its options and plan of measurements, the results file
written whole after every step, the Markdown table made from it, steps recorded as they end
(or skipped past the budget), a command killed at its time limit, the 8B build config, and the
bandwidth floor of a real (tiny) artifact."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.benchmark_scripts import BENCHMARKS, benchmark_script

headline = benchmark_script("headline")
results = benchmark_script("headline_results")
runs = benchmark_script("headline_runs")
artifacts = benchmark_script("headline_artifacts")
measurements = benchmark_script("headline_measurements")

ONE_B = [
    "copy_bandwidth",
    "mixed_1b",
    "mixed_1b_server",
    "tpot_1b",
    "tpot_1b_int4",
    "startup_1b",
    "speculative_1b",
    "mixed_1b_hf",
    "mixed_1b_hf_cb",
]


def test_help_lists_every_measurement():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "headline.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for name in [*ONE_B, "mixed_8b", "tpot_8b", "speculative_8b"]:
        assert f"  {name} " in out.stdout


def test_the_plan_runs_the_headline_figures_first_and_the_8b_only_when_asked():
    assert headline.parse_args([]).plan == ONE_B
    assert headline.parse_args(["--with-8b"]).plan == [
        *ONE_B,
        "mixed_8b",
        "tpot_8b",
        "speculative_8b",
    ]
    only = headline.parse_args(["--only", "tpot_1b_int4, copy_bandwidth"])
    assert only.plan == ["copy_bandwidth", "tpot_1b_int4"]  # in the run's order, not the option's
    skip = headline.parse_args(["--with-8b", "--skip", "mixed_1b_hf,mixed_1b_hf_cb,mixed_8b"])
    assert skip.plan == [*ONE_B[:7], "tpot_8b", "speculative_8b"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "mixed_1b,nonsense"], "unknown measurement nonsense"),
        (["--only", "tpot_8b"], "tpot_8b: give --with-8b"),
        (["--only", "tpot_1b", "--skip", "mixed_1b"], "--only and --skip: give one"),
    ],
)
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        headline.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def entry(name: str, status: str = "ok", **extra) -> dict:
    return {
        "name": name,
        "status": status,
        "command": f"trtc bench {name} | head",
        "card": "NVIDIA H100 80GB HBM3",
        "date": "2026-12-08T10:11:12Z",
        "seconds": 1.0,
        **extra,
    }


def test_the_results_file_is_whole_after_every_step(tmp_path):
    path = tmp_path / "headline.json"
    doc = results.ResultsFile(path, {"card": "NVIDIA H100 80GB HBM3"})
    assert json.loads(path.read_text())["entries"] == []
    for k in range(3):
        doc.add(entry(f"step{k}", "ok" if k != 1 else "failed"))
        on_disk = json.loads(path.read_text())
        assert [e["name"] for e in on_disk["entries"]] == [f"step{j}" for j in range(k + 1)]
    assert doc.ok("step1") is None and doc.ok("step2")["name"] == "step2"
    assert list(tmp_path.iterdir()) == [path]  # the temporary file renamed over it
    with pytest.raises(ValueError, match="status 'done'"):
        doc.add(entry("step3", "done"))


def test_the_table_has_a_row_per_figure_and_says_what_was_not_measured():
    doc = {
        "entries": [
            entry("copy_bandwidth", rows=[["copy bandwidth", "3.04 TB/s"]]),
            entry("mixed_1b", rows=[["in-process", "21,511"], ["a | b", "0.96x"]]),
            entry("startup_1b", "timed out", error="killed after 240 s, its time limit"),
            entry("tune_1b", "ok"),  # a step without figures makes no row
        ]
    }
    lines = results.table(doc).splitlines()
    assert lines[0] == "| metric | figure | card | date | command |"
    assert lines[2] == (
        "| copy bandwidth | 3.04 TB/s | NVIDIA H100 80GB HBM3 | 2026-12-08 10:11 UTC "
        "| `trtc bench copy_bandwidth \\| head` |"
    )
    assert lines[4].startswith("| a \\| b | 0.96x |")
    assert lines[5:] == [
        "",
        "- not measured: startup_1b (timed out: killed after 240 s, its time limit)",
    ]
    assert len(lines) == 7


def test_a_bench_result_becomes_its_row():
    result = {
        "mode": "inflight",
        "output_tokens_per_s": 21511.4,
        "duration_s": 3.6,
        "ttft_s": {"mean": 0.05, "p50": 0.0105, "p90": 0.12, "p99": 0.1858},
        "tpot_s": {"mean": 0.003, "p50": 0.0028, "p90": 0.0035, "p99": 0.004},
    }
    case = results.bench_case(result)
    assert results.bench_row("1.1B mixed workload, in-process", case) == [
        "1.1B mixed workload, in-process: output tok/s",
        "21,511 (TTFT p50 / p99 10.5 / 186 ms, TPOT p50 / p99 2.8 / 4 ms)",
    ]


def test_steps_are_recorded_as_they_end_and_skipped_past_the_budget(tmp_path):
    options = runs.Options(
        out=tmp_path / "h.json",
        log=tmp_path / "h.log",
        server_log=tmp_path / "h-server.log",
        work=tmp_path,
        given={},
        workloads=runs.SMOKE,
    )
    doc = results.ResultsFile(options.out, {})
    runner = runs.Runner(time.monotonic() + 600)
    h = runs.Headline(doc, runner, "a card", options)
    assert h.step("good", "cmd", lambda s, log: {"figures": {"x": 1}, "rows": []}, 10) == {"x": 1}
    assert h.step("bad", "cmd", lambda s, log: 1 / 0, 10) is None
    runner.deadline = time.monotonic() + runs.MIN_STEP_S - 5
    assert h.step("late", "cmd", lambda s, log: pytest.fail("ran"), 10) is None
    entries = json.loads(options.out.read_text())["entries"]
    assert [(e["name"], e["status"]) for e in entries] == [
        ("good", "ok"),
        ("bad", "failed"),
        ("late", "skipped"),
    ]
    assert entries[1]["error"] == "ZeroDivisionError: division by zero"
    assert entries[0]["card"] == "a card" and entries[0]["date"].endswith("Z")
    assert "==== good: cmd" in options.log.read_text()


def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path):
    runner = runs.Runner(time.monotonic() + 600)
    log = tmp_path / "log"
    pid_file = tmp_path / "child.pid"
    # a child that starts a grandchild, both sleeping past the limit
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    start = time.monotonic()
    with pytest.raises(runs.StepTimeout, match="killed after 2 s"):
        runner.run([sys.executable, "-c", code], 2, log)
    assert time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild)
    with pytest.raises(RuntimeError, match="exited with 3: boom"):
        runner.run([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 30, log)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_the_8b_config_is_the_1b_config_with_the_checkpoint(tmp_path):
    from trtc.compiler.config import parse_config

    checkpoint = tmp_path / "llama-3-8b-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    config = artifacts.config_8b(checkpoint)
    one_b = yaml.safe_load((artifacts.REPO / "configs/llama-1b-random.yaml").read_text())
    assert config["model"] == {"source": "hf", "path": str(checkpoint)}
    assert config["limits"] == one_b["limits"]
    assert one_b["limits"] == {"max_num_tokens": 4096, "max_num_seqs": 64, "max_seq_len": 2048}
    assert "output" not in config
    parsed = parse_config(yaml.safe_load(yaml.safe_dump(config)))
    assert parsed.precision == "fp16" and parsed.artifact_name == "llama-3-8b-random"


def test_the_tpot_floor_is_a_decode_steps_bytes_over_the_bandwidth(tiny_artifacts):
    from trtc.artifact import Artifact

    art = tiny_artifacts["tiny-llama"]  # configs/tiny-llama.yaml's model, precision and limits
    manifest = Artifact.open(art).manifest
    wb = manifest.graph.weight_bytes
    assert not manifest.model.tie_word_embeddings
    weights = wb["total"] - wb["embedding"] - wb["rope_tables"]  # the LM head read, not the table
    context = 16 + 32 // 2  # the middle of the decode
    kv = (context + 1) * manifest.kv_cache.bytes_per_token
    floor = measurements.tpot_floor_s(art, 1e9, prompt=16, output=32)
    assert floor == pytest.approx((weights + kv) / 1e9)
    assert measurements.tpot_floor_s(art, 2e9, 16, 32) == pytest.approx(floor / 2)
    assert not artifacts.is_tuned(art)
