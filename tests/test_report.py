"""The training report: PNGs, CSVs and the history JSON, from real and hand-built histories."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import make_data, tiny_pipeline

import dataflow as dfl
from dataflow.history.report import (
    REPORT_FIELDS,
    TERMS,
    ReportError,
    load_history,
    missing_fields,
    step_time_split,
    step_wall_times,
    write_report,
    write_tensorboard,
)
from dataflow.history.result import History

pytest.importorskip("matplotlib")

PNGS = ("training.png", "schedule.png", "replicas.png", "step_time.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def adaptive_history(*, optional: bool = True) -> History:
    """A history as the trainer writes it: an Adaptive schedule growing the batch over three
    phases on two replicas, one slower (its share shrinks), with evaluation each epoch.
    ``optional=False`` drops the fields older trainers did not write."""
    rng = np.random.default_rng(0)
    phases = []
    steps = []
    epochs = []
    clock, step_index = 0.0, 0
    layout = [(0, 2, 32, [16, 16]), (2, 4, 64, [40, 24]), (4, 6, 128, [84, 44])]
    for index, (start, end, batch, split) in enumerate(layout):
        per_epoch = 512 // batch
        n_steps = per_epoch * (end - start)
        step_seconds = 0.004 + batch * 2e-4
        phase_start = clock
        for k in range(n_steps):
            clock += step_seconds
            window_end = min(k // 8 + 1, n_steps / 8) * 8 * step_seconds  # windows of 8 steps
            steps.append(
                {
                    "step": step_index,
                    "phase": index,
                    "epoch": start + k // per_epoch,
                    "loss": float(1.1 * math.exp(-step_index / 60) + 0.05 * rng.random()),
                    "samples": batch,
                    "seconds": step_seconds,
                    "time": phase_start + window_end,  # stamped when the window arrives
                }
            )
            if optional:  # a cosine decay over the 6 epochs, on the phase's LR
                lr = 0.02 * batch / 32 * 0.5 * (1 + math.cos(math.pi * step_index / 96))
                steps[-1]["lr"] = lr
            step_index += 1
        stages = [
            {
                "Load": 0.01 * n_steps * step_seconds,
                "Forward": 0.35 * n_steps * step_seconds * local / (batch / 2),
                "Backward": 0.3 * n_steps * step_seconds * local / (batch / 2),
                "AllReduce": 0.15 * n_steps * step_seconds,
                "Update": 0.03 * n_steps * step_seconds,
                "Evaluate": 0.05 * n_steps * step_seconds,
            }
            for local in split
        ]
        phase = {
            "phase": index,
            "start_epoch": start,
            "end_epoch": end,
            "global_batch": batch,
            "lr": 0.02 * batch / 32,
            "local_batches": split,
            "samples_per_second": [local / (0.65 * step_seconds) for local in split],
            "steps": n_steps,
            "windows": n_steps // 8,
            "seconds": 1.1 * n_steps * step_seconds,
            "task_seconds": [n_steps * step_seconds] * 2,
            "stage_seconds": stages,
            "data_wait_fraction": [0.01, 0.01],
            "chunks_decoded": [4, 4],
            "peak_buffered_samples": [64, 64],
        }
        if optional:
            phase.update(
                micro_batches=[1, 2] if index == 2 else [1, 1],
                replicas=2,
                noise_scale=None if index == 0 else 40.0 * 2**index,
                gain=None if index == 0 else 1.0 + 0.6 * index,
                measured_noise_scale=50.0 * 2**index,
            )
        phases.append(phase)
    for epoch in range(6):
        epochs.append(
            {
                "epoch": epoch,
                "train_loss": 1.0 / (epoch + 1),
                "eval_loss": 1.1 / (epoch + 1),
                "eval_accuracy": 0.5 + 0.08 * epoch,
            }
        )
    info = {
        "run_id": "fit-handmade",
        "epochs": 6,
        "replicas": 2,
        "seed": 0,
        "stages": ["Load", "Forward", "Backward", "AllReduce", "Update", "Evaluate"],
        "workers": [{"rank": r, "device": "cpu"} for r in range(2)],
        "train_seconds": clock * 1.1,
        "fit_seconds": clock * 1.3,
    }
    return History(steps=steps, epochs=epochs, phases=phases, info=info)


def assert_report(out, written) -> None:
    for name in PNGS:
        path = out / name
        assert path in written
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    assert (out / "report.md").read_text().count("![") == len(PNGS)


def test_report_from_a_hand_built_history(tmp_path):
    history = adaptive_history()
    out = tmp_path / "report"
    written = write_report(history, out)
    assert_report(out, written)
    rows = list(csv.DictReader((out / "steps.csv").read_text().splitlines()))
    assert len(rows) == len(history.steps)
    assert int(rows[-1]["samples_seen"]) == sum(s["samples"] for s in history.steps)
    assert rows[-1]["global_batch"] == "128"
    assert [float(r["lr"]) for r in rows] == [s["lr"] for s in history.steps]  # each step's
    epochs = list(csv.DictReader((out / "epochs.csv").read_text().splitlines()))
    accuracy = [float(r["eval_accuracy"]) for r in epochs]
    assert accuracy == [e["eval_accuracy"] for e in history.epochs]
    assert History.from_json(out / "history.json") == History(
        **json.loads(json.dumps(history.to_dict()))
    )


def test_an_evaluation_of_part_of_the_held_out_set_is_said_in_the_report_and_summary(
    tmp_path,
):
    """A lost worker that took its share of an epoch's held-out scores with it, after the
    survivors had trained past that window (so it could not be trained again): the
    epoch's score covers part of the set, and the report and the summary say so."""
    history = adaptive_history()
    history.info["partial_evaluations"] = [{"epoch": 3, "scored": 200, "held_out": 300}]
    write_report(history, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Epoch 3's evaluation scored 200 of 300 held-out samples" in report
    summary = dfl.FitResult(model=None, history=history).summary()
    assert "epoch 3: the evaluation scored 200 of 300 held-out samples" in summary


def test_an_early_stop_is_said_in_the_report_as_in_the_summary(tmp_path):
    history = adaptive_history()
    history.info["stopped_early"] = {"after_epoch": 2, "reason": "eval_loss did not improve"}
    write_report(history, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "**Stopped early after epoch 2**: eval_loss did not improve." in report
    summary = dfl.FitResult(model=None, history=history).summary()
    assert "stopped early after epoch 2: eval_loss did not improve" in summary


def test_the_kept_weights_epoch_is_named_in_the_report_and_marked_in_the_plot(tmp_path):
    """keep_best: report.md and the summary name the kept epoch and its value; the
    training figure draws one more legend entry, the kept epoch's line."""
    history = adaptive_history()
    plain = tmp_path / "plain"
    write_report(history, plain)
    history.info["best"] = {
        "metric": "eval_accuracy", "mode": "max", "epoch": 3, "step": 40,
        "value": 0.8765, "path": "runs/ckpt/best.pt",
    }  # fmt: skip
    out = tmp_path / "report"
    assert_report(out, write_report(history, out))
    report = (out / "report.md").read_text()
    assert "**Kept weights (keep_best): epoch 3**, eval_accuracy 0.8765 (max)" in report
    assert "`runs/ckpt/best.pt`" in report
    assert "Kept weights" not in (plain / "report.md").read_text()
    summary = dfl.FitResult(model=None, history=history).summary()
    assert "best eval_accuracy 0.8765 after epoch 3 (result.best_model; saved to " in summary
    assert (out / "training.png").read_bytes() != (plain / "training.png").read_bytes()


def test_a_first_step_that_took_most_of_the_time_leaves_the_layout_whole(tmp_path):
    """One phase, its first step 20x the others (setup and the first compile in it), as
    `dataflow demo` often trains: the phase's label, centred on the phase from the
    training's start, stayed outside a wall-time axis that began at the first step's
    end, and matplotlib squeezed every panel to a sliver ("Tight layout not applied",
    an error here)."""
    times = [0.52, 0.53, 0.55, 0.56]
    steps = [
        {"step": i, "phase": 0, "epoch": 0, "loss": 1.1 - 0.01 * i, "samples": 64,
         "seconds": 0.5 if i == 0 else 0.01, "time": t}
        for i, t in enumerate(times)
    ]  # fmt: skip
    phase = {
        "phase": 0, "start_epoch": 0, "end_epoch": 1, "global_batch": 64, "lr": 0.02,
        "local_batches": [32, 32], "samples_per_second": [4000, 4000], "steps": 4,
        "windows": 3, "seconds": 0.6, "task_seconds": [0.6, 0.6],
        "stage_seconds": [{"Forward": 0.3}, {"Forward": 0.3}],
        "data_wait_fraction": [0.0, 0.0], "chunks_decoded": [1, 1],
        "peak_buffered_samples": [64, 64],
    }  # fmt: skip
    epochs = [{"epoch": 0, "train_loss": 1.1, "eval_loss": 1.1, "eval_accuracy": 0.36}]
    info = {"run_id": "fit-demo", "epochs": 1, "replicas": 2, "train_seconds": 0.6}
    history = History(steps=steps, epochs=epochs, phases=[phase], info=info)
    assert_report(tmp_path, write_report(history, tmp_path))


def test_report_of_an_old_history_without_the_optional_fields(tmp_path):
    history = adaptive_history(optional=False)
    history.phases[0].pop("task_seconds")
    for row in history.epochs:  # no evaluation
        row.pop("eval_loss"), row.pop("eval_accuracy")
    path = history.to_json(tmp_path / "history.json")
    written = write_report(path, tmp_path)  # the report beside the history it reads
    assert_report(tmp_path, written)
    assert (tmp_path / "history.json") not in written  # never overwrites its own input


def test_a_resumed_history_reports_every_run(tmp_path):
    """A fit stopped and resumed: two segments, the steps' times going on across the
    seam; the summary and the report's title divide every sample by both runs' seconds,
    and the wall-time panel marks the seam."""
    from dataflow.history.report_plots import _resume_seams
    from dataflow.history.result import FitResult

    history = adaptive_history()
    steps, split = history.steps, len(history.steps) // 2
    first = steps[split - 1]["time"] + 0.25  # its last checkpoint, after its last step
    history.info["segments"] = [
        {"run": 0, "start_step": 0, "end_step": split, "seconds": first},
        {"run": 1, "start_step": split, "end_step": len(steps), "seconds": 2.0},
    ]
    resumed_at = steps[split]["time"]
    for step in steps[split:]:  # the resumed run's clock starts later: times go on
        step["time"] = first + 0.5 * (step["time"] - resumed_at) + 0.1
    history.info["train_seconds"] = first + 2.0
    samples = sum(s["samples"] for s in steps)
    headline = FitResult(None, history).summary().splitlines()[0]
    assert f"over 2 runs ({samples / (first + 2.0):.0f} samples/s)" in headline
    times = step_wall_times(steps)
    assert (np.diff(times) >= 0).all()
    assert _resume_seams(history, times) == [times[split - 1]]
    out = tmp_path / "report"
    assert_report(out, write_report(history, out))
    assert "over 2 runs" in (out / "report.md").read_text()


def test_plots_lacking_their_fields_are_skipped_and_named(tmp_path):
    history = adaptive_history()
    for phase in history.phases:
        del phase["stage_seconds"]
    written = write_report(history, tmp_path)
    assert tmp_path / "training.png" in written
    assert tmp_path / "step_time.png" not in written
    assert "phases[0].stage_seconds" in (tmp_path / "report.md").read_text()


def test_step_time_split_adds_up_to_the_phase_wall_time():
    phase = adaptive_history().phases[1]
    info = {"stages": ["Load", "Forward", "Backward", "AllReduce", "Update", "Evaluate"]}
    split = step_time_split(phase, info)
    assert len(split) == 2 and set(split[0]) == set(TERMS)
    for terms, stages in zip(split, phase["stage_seconds"], strict=True):
        assert sum(terms.values()) * phase["steps"] == pytest.approx(phase["seconds"])
        assert terms["data wait"] * phase["steps"] == pytest.approx(stages["Load"])
        assert terms["exposed allreduce"] * phase["steps"] == pytest.approx(stages["AllReduce"])
        compute = stages["Forward"] + stages["Backward"] + stages["Update"]
        assert terms["compute"] * phase["steps"] == pytest.approx(compute)
        assert terms["evaluation"] * phase["steps"] == pytest.approx(stages["Evaluate"])


def test_stage_kinds_recorded_by_the_trainer_override_the_names():
    phase = {"steps": 1, "seconds": 1.0, "stage_seconds": [{"fetch": 0.2, "sync": 0.3}]}
    info = {"stage_kinds": {"fetch": "Load", "sync": "AllReduce"}}
    (terms,) = step_time_split(phase, info)
    assert terms["data wait"] == 0.2 and terms["exposed allreduce"] == 0.3
    assert terms["engine overhead"] == pytest.approx(0.5)


def test_wall_times_spread_a_window_of_steps_back_from_its_arrival():
    steps = [{"seconds": 1.0, "time": 3.0}] * 3 + [{"seconds": 1.0, "time": 5.0}] * 2
    assert step_wall_times(steps).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def one_phase_after_a_loss() -> History:
    """One phase of four replicas (as fast as each other) that lost a worker and went on:
    its record's seconds are not the fit's training seconds (the recovery, the final
    evaluation), and its epoch's last step is short (20 samples, not the batch of 32)."""
    history = adaptive_history()
    history.phases = history.phases[:1]
    phase = history.phases[0]
    for field in ("stage_seconds", "task_seconds", "data_wait_fraction", "micro_batches"):
        phase[field] = phase[field] * 2
    for field in ("chunks_decoded", "peak_buffered_samples"):
        phase[field] = phase[field] * 2
    phase.update(local_batches=[8] * 4, samples_per_second=[2400.0] * 4, replicas=4)
    history.info.update(replicas=4, workers=[{"rank": r, "device": "cpu"} for r in range(4)])
    history.steps = [s for s in history.steps if s["phase"] == 0]
    history.epochs = history.epochs[:2]
    history.steps[-1]["samples"] = 20
    history.phases[0]["seconds"] *= 0.8
    history.info["train_seconds"] = history.steps[-1]["time"] + 0.3
    return history


def test_replicas_whole_job_rate_is_the_titles_and_the_legend_hides_no_bar():
    """``replicas.png`` said "whole job 555/s" under a title of 541 samples/s (its phase's
    planned samples over the phase's own seconds); and its legend sat on the bars."""
    import re

    from dataflow.history.report import _matplotlib
    from dataflow.history.report_plots import replicas_figure, report_title

    history = one_phase_after_a_loss()
    samples = sum(s["samples"] for s in history.steps)
    title = report_title(history)
    expected = f"{samples / history.info['train_seconds']:,.0f}"
    assert f"({expected} samples/s)" in title, title
    plt = _matplotlib()
    fig, _ = replicas_figure(history, plt)
    try:
        fig.tight_layout()
        fig.canvas.draw()
        job = [t.get_text() for ax in fig.axes for t in ax.texts if "whole job" in t.get_text()]
        assert job == [f"whole job\n{expected}/s"], (job, title)
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends
        bars = [bar.get_window_extent() for ax in fig.axes for bar in ax.patches]
        assert bars
        for legend in legends:
            box = legend.get_window_extent()
            assert not any(box.overlaps(bar) for bar in bars), re.sub(r"\s+", " ", title)
    finally:
        plt.close(fig)


def test_missing_history_file_and_bad_json_are_clear(tmp_path):
    with pytest.raises(ReportError, match="no history file"):
        write_report(tmp_path / "nope.json", tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"losses": [1, 2]}')
    with pytest.raises(ReportError, match="not a dataflow history JSON"):
        load_history(bad)


def test_tensorboard_scalars_or_silently_nothing_without_it(tmp_path):
    import importlib.util

    history = adaptive_history()
    logdir = write_tensorboard(history, tmp_path / "tb")
    if importlib.util.find_spec("tensorboard") is None:
        assert logdir is None and not (tmp_path / "tb").exists()
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    assert len(events.Scalars("train/loss")) == len(history.steps)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx(
        [s["lr"] for s in history.steps], rel=1e-6
    )
    assert [e.value for e in events.Scalars("phase/global_batch")] == [32, 64, 128]
    assert len(events.Scalars("epoch/eval_accuracy")) == len(history.epochs)


@pytest.mark.slow
def test_a_real_fit_writes_every_field_the_report_reads(client, tmp_path):
    x, y = make_data(192)
    history = (
        tiny_pipeline(
            x[:160],
            y[:160],
            eval_source=dfl.io.ArraySource(x[160:], y[160:], shuffle=False),
            metrics={"loss": F.cross_entropy, "accuracy": dfl.stages.accuracy},
            schedule=dfl.schedule.Stepwise({0: 16, 1: 32}),
        )
        .fit(epochs=2, client=client)
        .history
    )
    assert missing_fields(history) == []
    for section, fields in REPORT_FIELDS.items():
        rows = [history.info] if section == "info" else getattr(history, section)
        assert rows, section
        for row in rows:
            assert set(fields) <= set(row), (section, set(fields) - set(row))
    assert {"eval_loss", "eval_accuracy"} <= set(history.epochs[-1])
    assert len(history.phases) == 2
    written = write_report(history, tmp_path)
    assert_report(tmp_path, written)
    rows = list(csv.DictReader((tmp_path / "steps.csv").read_text().splitlines()))
    assert [int(r["step"]) for r in rows] == [s["step"] for s in history.steps]
    assert all(s["lr"] > 0 for s in history.steps)  # each step's LR, recorded
