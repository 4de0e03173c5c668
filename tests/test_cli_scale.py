"""``dataflow scale``: the scaling table, the PNG, the published reproductions, bad input."""

import pytest

from dataflow.costmodel import presets
from dataflow.tools.cli import main


def test_scale_on_a_preset_writes_a_png(tmp_path, capsys):
    out = tmp_path / "scale.png"
    assert main(["scale", "--preset", "resnet50-a100-hdr", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4096" in printed and "exposed" in printed
    assert out.is_file() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_weak_and_schedule(capsys):
    assert main(["scale", "--local-batch", "64", "--max-workers", "64"]) == 0
    printed = capsys.readouterr().out
    assert "local batch 64" in printed and "\n     64 " in printed
    assert main(["scale", "--stepwise", "0:256,30:1024,60:4096", "--max-workers", "16"]) == 0
    assert "schedule" in capsys.readouterr().out
    assert main(["scale", "--adaptive", "256:4096", "--max-workers", "16"]) == 0


def test_scale_on_a_saved_model(tmp_path, capsys):
    path = presets.model("resnet50-v100-edr").save(tmp_path / "model.json")
    assert main(["scale", "--model", str(path), "--max-workers", "32"]) == 0
    assert "local batch 112" in capsys.readouterr().out


def test_published_prints_every_row(capsys):
    assert main(["scale", "--published"]) == 0
    printed = capsys.readouterr().out
    for key in ("horovod-resnet101", "horovod-inception_v3", "goyal-resnet50", "hu2022-resnet50"):
        assert key in printed
    assert "lacks:" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "resnet50-h10"], "did you mean 'resnet50-h100-ndr'"),
        (["--model", "/nonexistent/model.json"], "no cost model file"),
        (["--stepwise", "10:256"], "needs epoch 0"),
        (["--adaptive", "big:small"], "INITIAL:FINAL"),
    ],
)
def test_bad_input_exits_1_with_one_line(argv, message, capsys):
    assert main(["scale", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("dataflow: error:")


def test_unreadable_model_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["scale", "--model", str(bad)]) == 1
    assert "not JSON" in capsys.readouterr().err


def test_a_one_node_model_scales_with_a_network(tmp_path, capsys):
    from dataflow.costmodel import ComputeFit, CostModel, Link, Topology

    one_node = CostModel(
        compute=ComputeFit(points=((16, 0.02), (64, 0.06))),
        gradient_bytes=1 << 20,
        topology=Topology(intra=Link(latency_s=1e-4, bandwidth=1e9), per_node=2),
    ).save(tmp_path / "model.json")
    assert main(["scale", "--model", str(one_node), "--max-workers", "16"]) == 1
    assert "--network" in capsys.readouterr().err
    argv = ["scale", "--model", str(one_node), "--network", "ib-hdr", "--max-workers", "16"]
    assert main(argv) == 0
    assert "16" in capsys.readouterr().out


def _stepwise_model(tmp_path):
    """A model calibrated on one node of 2 workers that slow each other 1.6x, with a
    3 ms synchronous step and the dataset it was calibrated on (1,000 samples)."""
    from dataflow.costmodel import ComputeFit, CostModel, Link, Topology

    model = CostModel(
        compute=ComputeFit(points=((64, 0.08), (128, 0.15), (256, 0.29)), shared=((2, 1.6),)),
        gradient_bytes=300_000,
        topology=Topology(intra=Link(latency_s=2e-4, bandwidth=5e8), per_node=2),
        sync_overhead_s=0.003,
        window_overhead_s=0.004,
        phase_overhead_s=0.05,
        name="fieldnet",
        notes={"samples_per_epoch": "1000"},
    )
    return model, model.save(tmp_path / "model.json")


def _table_rows(printed):
    """(workers, epochs, global, local) of each phase row; workers carried down."""
    rows, workers, inside = [], None, False
    for line in printed.splitlines():
        if line.startswith("workers"):
            inside = True
            continue
        if not inside or line.startswith("-"):
            continue
        if line.startswith("time to train"):
            break
        cells = line.split()
        if cells[0].isdigit() and cells[1].isdigit():
            workers, cells = int(cells[0]), cells[2:]
        if cells[0] != "all":
            rows.append((workers, cells[0], int(cells[1]), int(cells[2])))
    return rows


def test_a_stepwise_schedule_shows_each_phase_its_time_and_why_efficiency_is_low(tmp_path, capsys):
    from dataflow.costmodel import presets, scaling
    from dataflow.costmodel.scaling_table import duration

    model, path = _stepwise_model(tmp_path)
    argv = ["scale", "--model", str(path), "--network", "ib-hdr", "--max-workers", "8"]
    assert main([*argv, "--stepwise", "0:256,30:1024,60:4096"]) == 0
    printed = capsys.readouterr().out
    # the header: the schedule, the epochs and the dataset it was calibrated on
    assert (
        "Stepwise schedule 0:256,30:1024,60:4096 over 90 epochs (--epochs) of 1,000 samples"
        in printed
    )
    assert "the calibrated source's" in printed
    assert "phase 0: epochs 0-30 at global batch 256 (30,000 samples)" in printed
    assert "phase 1: epochs 30-60 at global batch 1,024 (30,000 samples)" in printed
    assert "phase 2: epochs 60-90 at global batch 4,096 (30,000 samples)" in printed
    assert "x 38,435,010" not in printed and "256 x" not in printed
    # a row per phase, each with its own batch
    rows = _table_rows(printed)
    assert [r for r in rows if r[0] == 2] == [
        (2, "0-30", 256, 128),
        (2, "30-60", 1024, 512),
        (2, "60-90", 4096, 2048),
    ]
    assert {r[0] for r in rows} == {1, 2, 4, 8} and len(rows) == 4 * 3
    # the time to train, as the model predicts it (pure arithmetic)
    big = model.with_network(presets.interconnect("ib-hdr"))
    phases = scaling.stepwise_phases("0:256,30:1024,60:4096", epochs=90, samples_per_epoch=1000)
    one = big.schedule_efficiency(replicas=1, phases=phases)["seconds"]
    eight = big.schedule_efficiency(replicas=8, phases=phases)["seconds"]
    assert (
        f"time to train 90 epochs of 1,000 samples: {duration(one)} on 1 worker, "
        f"{duration(eight)} on 8 workers" in printed
    )
    # low efficiency is explained: 2 workers on one node slow each other 1.6x
    assert "why 2 workers reach" in printed
    assert "node sharing" in printed and "1.60x slower than one alone" in printed
    assert "sync_overhead_s" in printed


def test_without_a_dataset_size_the_command_names_the_flag(capsys):
    assert main(["scale", "--stepwise", "0:256,30:1024", "--max-workers", "4"]) == 0
    printed = capsys.readouterr().out
    assert (
        "of 1,281,167 samples (ImageNet's, the default: give yours with --samples-per-epoch)"
        in (printed)
    )
    argv = ["scale", "--stepwise", "0:256,30:1024", "--max-workers", "4", "--epochs", "40"]
    assert main([*argv, "--samples-per-epoch", "5000"]) == 0
    printed = capsys.readouterr().out
    assert "phase 1: epochs 30-40 at global batch 1,024 (50,000 samples)" in printed
    assert "time to train 40 epochs of 5,000 samples" in printed


def test_the_efficiency_losses_add_up_to_the_model_schedule_efficiency(tmp_path):
    from dataflow.costmodel import presets, scaling
    from dataflow.costmodel.scaling_table import losses, schedule_rows

    model, _ = _stepwise_model(tmp_path)
    model = model.with_network(presets.interconnect("ib-hdr"))
    phases = scaling.stepwise_phases("0:256,30:1024,60:4096", epochs=90, samples_per_epoch=1000)
    for row in schedule_rows(model, phases=phases, samples_per_epoch=1000, counts=[1, 2, 8]):
        whole = model.schedule_efficiency(replicas=row.replicas, phases=phases)
        assert row.efficiency == pytest.approx(whole["efficiency"])
        assert row.seconds == pytest.approx(whole["seconds"])
        assert row.efficiency + sum(row.lost.values()) / row.seconds == pytest.approx(1.0)
    step = model.breakdown(replicas=2, global_batch=256)
    lost = losses(model, replicas=2, global_batch=256)
    alone = model.breakdown(replicas=1, global_batch=128).step_s
    assert step.step_s - alone == pytest.approx(sum(lost.values()))
    assert lost["node sharing"] == pytest.approx(0.6 * model.compute.seconds(128))
    assert lost["sync"] == pytest.approx(0.003)
    assert lost["batchnorm"] == 0.0  # no sync_batchnorm
    synced = model.replace(batchnorm_channels=(64, 128, 256))  # its reductions: a cause too
    lost = losses(synced, replicas=2, global_batch=256)
    step = synced.breakdown(replicas=2, global_batch=256)
    assert lost["batchnorm"] == pytest.approx(step.batchnorm_s) and step.batchnorm_s > 0
    assert step.step_s - alone == pytest.approx(sum(lost.values()))
