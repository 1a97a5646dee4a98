"""The GPU node check (`tfscale-gpu-check`, launch/gpu_check/): its
verdicts, its budget, its layouts, and a real `--tiny` run on this CPU
killed halfway, which keeps what it measured."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launch.gpu_check import cli, figures, phases, report
from tests.conftest import REPO
from tfscale.resume import compare


def test_bus_bandwidth_is_nccl_tests_definition():
    # 8 ranks, 1 GB in 10 ms: algbw 100 GB/s, busbw x 2 x 7 / 8.
    assert figures.bus_bandwidth(10**9, 0.01, 8) == pytest.approx(175e9)
    assert figures.bus_bandwidth(10**9, 0.01, 2) == pytest.approx(100e9)


TOPO = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\t0-55\t0
GPU1\tNV18\t X \tPIX\t0-55\t0
GPU2\tSYS\tPIX\t X \t56-111\t1
"""


def test_the_link_between_two_gpus_is_read_from_nvidia_smi_topo():
    assert figures.link_between(TOPO) == "NV18: NVLink"
    assert figures.link_between(TOPO, 1, 2) == "PIX: PCIe (one switch)"
    assert figures.link_between(TOPO, 0, 2) == ("SYS: PCIe and the CPUs' "
                                                  "link")
    assert figures.link_between("") is None


@pytest.mark.parametrize("delivered,first,comparison,verdict", [
    # Two uninterrupted deterministic runs compare equal: that proves
    # nothing, so no signal, no comparison (mutation tried: the check
    # removed -> "resumed bit-identical" here).
    (False, 0, {"bit_identical": True}, "not compared: no SIGTERM was "
     "delivered"),
    (True, 0, {"bit_identical": True}, "not compared: the signalled run "
     "exited 0, not 143"),
    (True, 143, None, "not compared: the rerun did not end"),
    (True, 143, {"bit_identical": False}, "resumed, NOT bit-identical"),
    (True, 143, {"bit_identical": True}, "resumed bit-identical")])
def test_the_sigterm_row_counts_only_a_delivered_signal_and_exit_143(
        delivered, first, comparison, verdict):
    row = figures.sigterm_row(delivered, first, 1.2, 1.5, 0, comparison)
    assert row["verdict"] == verdict
    assert row["passed"] is (verdict == "resumed bit-identical")


def test_each_node_gets_its_layout_and_launch_command(tmp_path):
    eight = phases.Node([str(i) for i in range(8)], "local", False)
    assert (eight.workers, eight.shared) == (8, False)
    assert eight.launched(["train"])[-4:] == ["--gpus_per_worker", "1", "--",
                                              "train"]
    assert "NCCL" in eight.layout()
    one = phases.Node(["0"], "local", False)
    assert (one.workers, one.shared) == (2, True)
    assert "--share_gpus" in one.launched(["train"])
    assert "sharing GPU 0 over the gRPC ring" in one.layout()
    slurm = phases.Node(["0", "1"], "srun", False)
    assert slurm.launched(["train"]) == ["srun", "--ntasks", "2",
                                         "--gpus-per-task", "1", "train"]
    args = cli.parse_args(["--output_dir", str(tmp_path), "--gpus",
                                 "2"])
    four = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert cli.node_of(args, four).gpus == ["4", "5"]
    assert cli.node_of(args, {"CUDA_VISIBLE_DEVICES": "4,5",
                                    "SLURM_JOB_ID": "7", "SLURM_NNODES": "2",
                                    "SLURM_NTASKS": "16"}).workers == 16
    with pytest.raises(ValueError, match="--gpus 2: this node sees 1 GPU"):
        cli.node_of(args, {"CUDA_VISIBLE_DEVICES": "3"})


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_phases_that_do_not_fit_the_budget_are_skipped_and_named(
        tmp_path, monkeypatch):
    """Each phase's results on disk as soon as it ends; a phase whose
    estimate exceeds what is left is skipped with the figures, and the
    phases that need it too."""
    clock = FakeClock()
    written = []

    def phase(seconds):
        def run(check):
            clock.now += seconds
            written.append(json.loads(
                (tmp_path / "results.json").read_text())["phases"].keys())
            return {"row": {"passed": True}}
        return run
    monkeypatch.setattr(phases, "RUNS", {
        "records": phase(10), "equivalence": phase(140), "speed": phase(500),
        "all-reduce": phase(40), "resume": phase(90), "speed-1": phase(90)})
    args = cli.parse_args(["--output_dir", str(tmp_path),
                                 "--budget_seconds", "530"])
    check = type("Check", (), {"args": args,
                               "budget": report.Budget(530, clock)})()
    results = report.Results(str(tmp_path), {"title": "test"})
    assert phases.run_phases(check, results)
    data = json.loads((tmp_path / "results.json").read_text())
    # records, equivalence, speed ran (speed past its estimate: 650 s);
    # nothing fits after it.
    assert list(data["phases"]) == ["records", "equivalence", "speed"]
    assert data["skipped"]["all-reduce"] == (
        "estimated 45 s, 0 s left of --budget_seconds 530")
    assert set(data["skipped"]) == {"all-reduce", "resume", "speed-1"}
    # Written after each phase: the third saw the first two.
    assert [list(w) for w in written] == [[], ["records"],
                                          ["records", "equivalence"]]
    assert "| all-reduce | skipped | estimated 45 s" in (
        tmp_path / "table.md").read_text()


def test_the_default_phases_fit_the_default_budget():
    """docs/gpus.md's table: the estimates' sum within a 10-minute call
    less the setup."""
    args = cli.parse_args(["--output_dir", "x"])
    assert sum(gpu for _, gpu, _, _ in figures.PHASES) <= \
        args.budget_seconds <= 600 - 45
    docs = open(os.path.join(REPO, "docs", "gpus.md")).read()
    for name, gpu, rests_on, _ in figures.PHASES:
        assert f"| {name} | {gpu} s | {rests_on} |" in docs, name


def test_near_zero_tensors_are_compared_against_the_floor():
    a = {"w": np.array([0.5, -0.25]), "key_bias": np.array([1e-10, 0.0])}
    b = {"w": np.array([0.5, -0.25 + 5e-7]),
         "key_bias": np.array([-2e-10, 0.0])}
    found = compare.compare(a, b)
    # w: 5e-7 / 0.5; key_bias: 3e-10 against the floor, 1e-4.
    assert found["max_relative_difference"] == pytest.approx(3e-6)
    assert not found["bit_identical"] and found["tensors"] == 2
    with pytest.raises(ValueError, match="different weights"):
        compare.compare(a, {"w": a["w"]})


@pytest.mark.slow
def test_a_tiny_check_killed_halfway_keeps_the_phases_it_finished(tmp_path):
    """The real command on this CPU: SIGKILLed once two phases are done,
    its results.json and table.md hold them (the equivalence passed, every
    worker's placement line in it)."""
    out = tmp_path / "check"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.gpu_check", "--output_dir", str(out),
         "--tiny", "--steps", "12", "--save_steps", "4", "--log_steps", "4"],
        cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    results = out / "results.json"
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and "equivalence" in json.loads(
                    results.read_text())["phases"]:
                break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0].decode(errors="replace")
    data = json.loads(results.read_text())
    assert list(data["phases"])[:2] == ["records", "equivalence"], output
    rows = data["phases"]["equivalence"]
    assert rows["2 workers against 1"]["passed"], rows
    assert rows["2 workers against 1"]["tensors"] > 100  # weights and slots
    assert len(rows["2 workers"]["placement"]) == 2
    assert "| equivalence | 2 workers against 1 |" in (
        out / "table.md").read_text()
