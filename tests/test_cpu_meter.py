"""The CPU meter (``dataflow.tools.cpu_meter``): who kept the machine busy. The
arithmetic is pure and tested on made-up samples; one real use checks the fields."""

from __future__ import annotations

import os

import pytest

from dataflow.tools.cpu_meter import CpuMeter, busy_seconds, cores_per_process


def test_cores_per_process_splits_the_busiest_thread_from_the_others():
    a = (10.0, {(1, 1): 5.0, (1, 2): 1.0, (7, 1): 0.0, (9, 1): 3.0})
    b = (12.0, {(1, 1): 6.0, (1, 2): 1.5, (7, 1): 2.0, (9, 1): 3.0})  # 2 s later
    rows = cores_per_process(a, b, me=1)
    assert rows == [
        {
            "process": "driver",
            "cores": 0.75,
            "busiest_thread": 0.5,
            "other_threads": 0.25,
            "threads": 2,
        },
        {
            "process": "child 7",
            "cores": 1.0,
            "busiest_thread": 1.0,
            "other_threads": 0.0,
            "threads": 1,
        },
    ]  # fmt: skip  (process 9 was idle: left out)
    assert cores_per_process(b, b, me=1) == []  # no time between the samples


def test_busy_seconds_reads_the_machines_counters():
    tick = os.sysconf("SC_CLK_TCK")
    stat = f"cpu  {4 * tick} {tick} {2 * tick} 900 7 {tick} 0 {3 * tick} 0 0\ncpu0 1 2 3\n"
    assert busy_seconds(stat) == (8.0, 3.0)  # user+nice+system+irq+softirq; steal


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux counters")
def test_a_metered_block_reports_its_own_and_foreign_cpu():
    with CpuMeter() as meter:
        sum(i * i for i in range(2_000_000))  # ~0.1 CPU s of our own (ticks are 10 ms)
    fields = meter.as_dict()
    assert set(fields) == {
        "wall_seconds", "busy_cpu_seconds", "our_cpu_seconds", "foreign_cpu_seconds",
        "steal_cpu_seconds",
    }  # fmt: skip
    assert all(v >= 0 for v in fields.values()) and meter.our_cpu_seconds > 0
    rows = meter.threads_between(0.0, 1.0)  # (a loaded machine may leave out our row)
    assert all(r["process"] == "driver" or r["process"].startswith("child ") for r in rows)
