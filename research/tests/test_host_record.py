"""The host record each comparison run keeps: its probe's CPU time is real work, and it scales with the work."""

from __future__ import annotations

import subprocess
import sys

from research.harness import compare


def _probe(repeats: int) -> float:
    code = compare._PROBE.replace("range(50)", f"range({repeats})")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_host_record_names_the_machine_and_times_the_probe():
    record = compare.host_record()
    assert set(record) == {"cpu", "cpus", "probe_cpu_seconds"}
    assert record["cpus"] >= 1 and record["probe_cpu_seconds"] > 0
    assert compare.host_record() is record  # measured once per process


def test_the_probe_measures_its_work():
    # four times the matmuls take about four times the CPU time (not wall time, not a constant)
    one, four = min(_probe(10) for _ in range(2)), min(_probe(40) for _ in range(2))
    assert 2.5 < four / one < 6.0
