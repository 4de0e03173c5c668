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


UNGUARDED_SCRIPT = """
import numpy as np, torch, torch.nn.functional as F
import dataflow as dfl
x = np.zeros((8, 1, 4, 4), np.float32); y = np.zeros(8, np.int64)
dfl.Pipeline(model=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2)),
             loss=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
             source=dfl.io.ArraySource(x, y), schedule=dfl.schedule.Fixed(4)).fit(epochs=1)
"""


@pytest.mark.slow
def test_script_without_main_guard_gets_a_clear_error(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "ConfigError: the embedded LocalCluster's worker processes failed" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
