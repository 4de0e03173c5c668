import json

import pytest

from dataflow.cli import build_parser, main


@pytest.mark.slow
def test_demo_trains_and_writes_history(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(
        [
            "demo",
            "--samples",
            "256",
            "--eval-samples",
            "64",
            "--epochs",
            "2",
            "--workers",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "trained 2 epoch(s)" in printed
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [0, 1]
    assert history["info"]["replicas"] == 2
    assert (out / "model.pt").exists()


def test_help_lists_the_demo():
    assert "demo" in build_parser().format_help()
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
