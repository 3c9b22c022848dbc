"""Exit codes for scripts and CI: 0 done, 1 a result to stop on, 2 bad input; and `--version`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import yaml

from fsdp_sim.cli import main

TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}
HUGE = TINY | {"report": {"safety_margin": 0.99}}  # a 0.8 GB budget: the CUDA context alone is more
LONG = TINY | {"model": {"hidden": 16384, "layers": 64, "heads": 128, "vocab": 256}}  # 206 B params: past the GPU


def _file(tmp_path, data, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_require_fit(tmp_path, capsys):
    small, huge = _file(tmp_path, TINY), _file(tmp_path, HUGE, "huge.yaml")
    assert main(["run", small, "--require-fit"]) == 0
    assert main(["run", huge]) == 0  # without the flag a step that does not fit is still a result
    capsys.readouterr()
    assert main(["run", huge, "--require-fit"]) == 1  # it runs, but not with the margin kept
    out, err = capsys.readouterr()
    assert "FITS INSIDE THE MARGIN" in out and err.count("\n") == 1 and "fits only inside the safety margin" in err
    assert main(["run", _file(tmp_path, LONG, "long.yaml"), "--require-fit"]) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and err.count("\n") == 1 and "does not fit" in err
    assert main(["run", huge, "--require-fit", "-q"]) == 1
    assert capsys.readouterr() == ("", "")


def test_sweep_fails_only_when_every_row_failed(tmp_path, capsys):
    path = _file(tmp_path, TINY)
    assert main(["sweep", path, "--set", "fsdp.shard_size=3,5", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    assert out.count("does not divide") == 2 and err.startswith("fsdp-sim: every configuration failed")
    assert main(["sweep", path, "--set", "fsdp.shard_size=3,8", "--jobs", "1", "-q"]) == 0
    assert main(["sweep", path, "--set", "training.micro_batch=1", "--jobs", "1", "-q"]) == 0


def test_recommend_fails_when_nothing_fits(tmp_path, capsys):
    path = _file(tmp_path, HUGE)
    assert main(["recommend", path, "--set", "training.activation_checkpointing=none", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("No configuration fits.") and "no configuration fits" in err


def test_bad_input_is_still_exit_2(tmp_path, capsys):
    path = _file(tmp_path, TINY)
    for argv in (["sweep", path, "--set", "fsdp.wrap"], ["recommend", path, "--jobs", "0"],
                 ["recommend", path, "--top", "-1"], ["sweep", path, "--set", "a=1", "--color-by", "b", "--plot", "x.png"],
                 ["recommend", str(tmp_path / "nowhere.yaml")], ["run", path, "--require-fit", "--nope"]):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        err = capsys.readouterr().err
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("fsdp-sim: error: "), (argv, err)


def test_version():
    p = subprocess.run([sys.executable, "-m", "fsdp_sim.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"fsdp-sim {version('fsdp-sim')}"
