"""``dataflow scale``: the scaling table, the PNG, the published reproductions, bad input."""

import pytest

from dataflow.cli import main
from dataflow.costmodel import presets


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
