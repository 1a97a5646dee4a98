"""The offline install route (`python -m launch.wheelhouse`, docs/gpus.md
"A GPU host without internet"): a wheelhouse built for this platform,
checked against its SHA256SUMS and installed with pip's index off in a
fresh virtualenv, where tfscale and TensorFlow import and the console
scripts run; the GPU extra's wheels named (resolved for Python 3.12), not
downloaded."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def run(command, **kwargs):
    kwargs.setdefault("cwd", REPO)
    out = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out.stdout


def test_a_wheelhouse_installs_offline_in_a_fresh_virtualenv(tmp_path):
    house = tmp_path / "wheels"
    run([sys.executable, "-m", "launch.wheelhouse", "--output", str(house)])
    manifest = json.loads((house / "manifest.json").read_text())
    wheels = sorted(p.name for p in house.glob("*.whl"))
    assert sorted(manifest["wheels"]) == wheels
    assert any(w.startswith("tensorflow-2.21.") for w in wheels)
    assert any(w.startswith("tfscale-") for w in wheels)
    for line in (house / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((house / name).read_bytes()).hexdigest() == \
            digest, name
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    offline = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    run([str(venv / "bin" / "pip"), "install", "-q", "--no-index",
         "--find-links", str(house), "tfscale"], env=offline)
    said = run([str(venv / "bin" / "python"), "-c",
                "import tensorflow as tf, tfscale, launch.gpu_check; "
                "print(tf.__version__)"], cwd=tmp_path)
    assert said.strip().splitlines()[-1].startswith("2.21.")
    assert "tfscale-gpu-check" in run(
        [str(venv / "bin" / "tfscale-gpu-check"), "--help"])


def test_the_gpu_extras_wheels_are_named_without_downloading_them(tmp_path):
    house = tmp_path / "listed"
    names = run([sys.executable, "-m", "launch.wheelhouse", "--output",
                 str(house), "--list", "--extras", "and-cuda",
                 "--python-version", "3.12"]).split()
    assert "tensorflow==2.21.0" in names
    nccl = [n for n in names if n.startswith("nvidia-nccl-cu12==")]
    assert nccl and int(nccl[0].split("==")[1].split(".")[1]) >= 27
    assert any(n.startswith("nvidia-cudnn-cu12==") for n in names)
    # Only tfscale's own wheel was built there.
    assert [p.name.split("-")[0] for p in house.glob("*.whl")] == ["tfscale"]
