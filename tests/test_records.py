"""The history's schema: typed records that read as dicts, and their JSON."""

import math

from dataflow.history.records import EpochRecord, PhaseRecord, StepRecord
from dataflow.history.report_data import REPORT_FIELDS, missing_fields
from dataflow.history.result import History


def _phase() -> PhaseRecord:
    return PhaseRecord(
        phase=0, start_epoch=0, end_epoch=1, global_batch=8, lr=0.1, local_batches=[4, 4],
        samples_per_second=[10.0, 9.0], steps=4, seconds=1.5,
        stage_seconds=[{"Forward": 1.0}, {"Forward": 1.1}],
    )  # fmt: skip


def test_records_read_as_dicts_and_equal_the_dicts_of_a_loaded_history(tmp_path):
    step = StepRecord(step=0, phase=0, epoch=0, loss=float("nan"), samples=8, seconds=0.1,
                      time=0.2)  # fmt: skip
    epoch = EpochRecord(0, 1.25, {"eval_accuracy": 0.5})
    history = History(steps=[step], epochs=[epoch], phases=[_phase()], info={"run_id": "r"})
    assert step["samples"] == 8 and step.get("nope") is None and "loss" in step
    assert epoch["eval_accuracy"] == 0.5 and set(epoch) == {"epoch", "train_loss", "eval_accuracy"}
    assert history.phases[0] == dict(history.phases[0])  # a record equals its dict
    loaded = History.from_json(history.to_json(tmp_path / "h.json"))
    assert loaded.epochs[0] == epoch.to_dict() and loaded.phases[0]["lr"] == 0.1
    assert math.isnan(float(loaded.steps[0]["loss"]))  # strict JSON: "nan"


def test_an_epoch_counts_the_held_out_samples_its_evaluation_scored(tmp_path):
    evaluated = EpochRecord(0, 1.25, {"eval_loss": 0.5}, held_out_samples=90)
    assert evaluated["held_out_samples"] == 90
    assert set(evaluated) == {"epoch", "train_loss", "eval_loss", "held_out_samples"}
    plain = EpochRecord(1, 1.0)  # no evaluation: no count, as in older histories
    assert "held_out_samples" not in plain and plain.get("held_out_samples") is None
    history = History(epochs=[evaluated, plain], info={})
    loaded = History.from_json(history.to_json(tmp_path / "h.json"))
    assert loaded.epochs == [evaluated.to_dict(), plain.to_dict()]
    assert loaded.epochs[0]["held_out_samples"] == 90


def test_the_report_needs_exactly_the_records_fields():
    assert REPORT_FIELDS["steps"] == (
        "step",
        "phase",
        "epoch",
        "loss",
        "samples",
        "seconds",
        "time",
    )
    assert "stage_seconds" in REPORT_FIELDS["phases"]
    history = History(phases=[_phase()], info={})
    assert [m for m in missing_fields(history) if m.startswith("phases")] == []


def test_a_failure_record_is_typed_reads_as_a_dict_and_is_completed_by_field():
    import pytest

    from dataflow.core.plain import to_plain
    from dataflow.history.records import FailureRecord

    record = FailureRecord(reason="lost workers", phase=0, commit_step=24, lost=["tcp://b"])
    assert record["commit_step"] == 24 and "replicas_after" not in record  # None: absent
    record.update({"replicas_after": 2}, resumed_at=5.0)
    record["joined"] = []
    assert record == {"reason": "lost workers", "phase": 0, "commit_step": 24,
                      "lost": ["tcp://b"], "replicas_after": 2, "joined": [],
                      "resumed_at": 5.0}  # fmt: skip
    with pytest.raises(KeyError, match="no field 'replica_after'"):
        record["replica_after"] = 2  # a typo is an error, not a new key
    copy = record.copy()
    copy.lost.append("tcp://c")
    assert record.lost == ["tcp://b"]
    assert to_plain({"failures": [record]}, json=True)["failures"][0]["replicas_after"] == 2


def test_a_loaded_history_holds_records_like_a_fresh_fit_and_reads_as_written(tmp_path):
    """JSON and checkpoints hold dicts: loaded back, the rows are the fit's record types
    again (``e.train_loss`` works on every path), NaN is a float again, and each row
    reads key for key as it was written (an older row's absent fields stay absent)."""
    step = StepRecord(step=0, phase=0, epoch=0, loss=float("nan"), samples=8, seconds=0.1,
                      time=0.2, skipped=True)  # fmt: skip
    epoch = EpochRecord(0, float("inf"), {"eval_loss": float("nan")}, held_out_samples=9)
    history = History(steps=[step], epochs=[epoch], phases=[_phase()], info={"run_id": "r"})
    for loaded in (
        History.from_json(history.to_json(tmp_path / "h.json")),
        History.from_dict(history.to_dict()),  # a checkpoint's history, restored
    ):
        assert [type(r) for r in (*loaded.steps, *loaded.epochs, *loaded.phases)] == [
            StepRecord, EpochRecord, PhaseRecord,
        ]  # fmt: skip
        assert math.isnan(loaded.steps[0].loss) and loaded.steps[0].skipped is True
        assert loaded.epochs[0].train_loss == math.inf
        assert math.isnan(loaded.epochs[0].metrics["eval_loss"])
        assert loaded.epochs[0].held_out_samples == 9
        assert loaded.phases[0].local_batches == [4, 4] and loaded.phases[0].lr == 0.1
        assert set(loaded.phases[0]) == set(history.phases[0])
    old = {"phase": 0, "start_epoch": 0, "end_epoch": 1, "global_batch": 8, "lr": 0.1,
           "local_batches": [8], "samples_per_second": [1.0], "steps": 1, "seconds": 1.0,
           "stage_seconds": [{}], "retired_field": 3}  # fmt: skip
    row = History.from_dict({"phases": [old], "steps": [{"step": 0, "loss": "nan"}]})
    assert row.phases[0] == old and row.phases[0].replicas == 1  # the default, not a key
    assert "time" not in row.steps[0] and row.steps[0].time is None  # older: no time
    assert math.isnan(row.steps[0]["loss"])
