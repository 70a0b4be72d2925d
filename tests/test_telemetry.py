"""Timeline (Chrome trace, one row per rank), the metrics log, consensus metrics and the plot."""
import json

from hvd_sgp import plot
from mpi_launch import run_mpi


def test_timeline_metrics_and_plot(tmp_path):
    timeline = tmp_path / "timeline.json"
    logs = []
    for topology in ("exponential", "ring"):
        log = tmp_path / f"{topology}.jsonl"
        env = {"HVD_SGP_METRICS": str(log), "HVD_SGP_METRICS_EVERY": "5"}
        if topology == "exponential":
            env["HOROVOD_TIMELINE"] = str(timeline)  # Horovod's variable works too
            env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"  # sgprun --timeline-mark-cycles
        out = run_mpi(3, "telemetry_checks.py", topology, env=env).stdout
        assert "all telemetry checks passed on 3 ranks" in out
        logs.append(str(log))
    trace = json.loads(timeline.read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1, 2}
    names = {e["name"] for e in trace}
    assert {"compute", "send/receive", "wait", "process_name"} <= names
    assert not list(tmp_path.glob("timeline.json.rank*"))  # merged and removed
    marks = [(e["pid"], e["args"]["step"]) for e in trace if e["name"] == "CYCLE_START"]
    assert sorted(marks) == [(rank, step) for rank in range(3) for step in range(1, 41)]
    records = [json.loads(line) for line in open(logs[1])]
    assert [r["step"] for r in records] == list(range(5, 41, 5))
    assert all(len(r["deviation"]) == 3 and r["label"].startswith("sgp ring") for r in records)
    png = tmp_path / "deviation.png"
    plot.main(logs + ["-o", str(png)])
    assert png.stat().st_size > 10_000
