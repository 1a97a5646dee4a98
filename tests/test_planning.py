"""tfscale-plan: the projection checked against published multi-node
tables (calibrated on their smallest rows, predicting the rest), its terms
by hand, and the command's edges."""

import dataclasses
import json
import math
from unittest import mock

import pytest

from planning import calibrate, cli, collectives, projection, published
from planning import systems
from planning.workload import Workload

A100 = "nvidia_tf2_bert_large_dgx_a100"
DGX2H = "nvidia_tf2_bert_large_dgx_2h"
HOROVOD_MODELS = ("inception_v3", "resnet_101", "vgg_16")


def golden_checks() -> dict:
    """Each acceptance check of the published tables: True when it holds."""
    a100 = published.nvidia_bert(A100)
    dgx2h = published.nvidia_bert(DGX2H)
    checks = {f"a100 {n} nodes within 10%":
              abs(a100[n]["predicted"] / a100[n]["published"] - 1) <= 0.10
              for n in (8, 32)}
    checks["dgx-2h scales worse than dgx-a100 at 32 nodes"] = (
        dgx2h[32]["predicted_efficiency"] < a100[32]["predicted_efficiency"])
    for model in HOROVOD_MODELS:
        result = published.horovod(model)
        points = 10 if model == "vgg_16" else 5
        checks[f"horovod {model} within {points} points"] = (
            abs(result["predicted"] - result["published"]) <= points / 100)
    return checks


def test_published_tables_are_predicted_from_their_smallest_rows():
    checks = golden_checks()
    assert all(checks.values()), checks
    # The calibrating rows come back exactly.
    a100 = published.nvidia_bert(A100)
    for nodes in (1, 2):
        assert a100[nodes]["predicted"] == pytest.approx(
            a100[nodes]["published"], rel=1e-3)


def test_the_golden_checks_fail_without_the_sync_term():
    with mock.patch.object(projection.collectives, "gradient_sync",
                           lambda *args, **kwargs: 0.0):
        checks = golden_checks()
    assert not all(checks.values()), checks


def test_every_published_figure_names_its_source_and_row():
    for name, table in published.load().items():
        assert table["source"] and table["path"] and table["table"], name
        for row in table.get("rows", []):
            if "accumulation" in row:
                assert str(row["throughput"]) in row["row"], (name, row)


def test_ring_and_tree_by_hand():
    system = systems.PRESETS["dgx-a100"]
    size = 1e9
    one_node = collectives.ring(system, 1, size)
    assert one_node == pytest.approx(
        system.base_latency + 2 * 8 * system.intra_latency
        + 2 * 7 / 8 * size / system.intra_bandwidth)
    four = collectives.ring(system, 4, size)
    assert four == pytest.approx(
        system.base_latency + 2 * (4 * system.nic_latency
                                   + 28 * system.intra_latency)
        + 2 * 31 / 32 * size / system.network_bandwidth)
    assert collectives.tree(system, 4, size) == pytest.approx(
        system.base_latency + 2 * (7 * system.intra_latency
                                   + 2 * system.nic_latency)
        + 2 * size / system.network_bandwidth)
    # auto: the tree's log latency wins for small buffers on many nodes,
    # the ring's 2 (R - 1) / R for big ones.
    assert collectives.all_reduce(system, 512, 1e3) == collectives.tree(
        system, 512, 1e3)
    assert collectives.all_reduce(system, 2, 1e9) == collectives.ring(
        system, 2, 1e9)
    assert collectives.ring(system, 1, size) < collectives.ring(
        system, 2, size)
    assert collectives.buffers(1.34e9, 64e6) == 21


def test_a_link_fit_recovers_latency_and_bandwidth():
    sizes = [2 ** k for k in range(16, 28, 2)]
    seconds = [50e-6 + 2 * 2 / 3 * s / 2e9 for s in sizes]
    latency, bandwidth = collectives.fit_link(sizes, seconds, ranks=3)
    assert latency == pytest.approx(50e-6, rel=1e-6)
    assert bandwidth == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        collectives.fit_link([1, 1], [1, 2], 2)


def bert_large(**changes) -> Workload:
    fields = dict(parameters=336e6, micro_batch=64, accumulation=4,
                  micro_seconds=0.2, gradient_bytes=2, update_seconds=0.01,
                  fixed_seconds=0.002, jitter=0.02)
    fields.update(changes)
    return Workload(**fields)


def test_the_split_term_by_term():
    system = systems.PRESETS["dgx-h100"]
    w = bert_large()
    alone = projection.step_split(w, system, 1)
    assert alone == {"compute": 0.8, "update": 0.01, "fixed": 0.002,
                     "sync": 0.0, "straggler": 0.0}
    split = projection.step_split(w, system, 64)
    assert split["sync"] == pytest.approx(collectives.gradient_sync(
        system, 8, w.gradient_size))
    assert split["straggler"] == pytest.approx(
        0.02 * 0.2 * 2 * projection.expected_max(64))
    sharded = projection.step_split(w, system, 64, projection.Plan(zero1=True))
    assert sharded["update"] == pytest.approx(0.01 / 64)
    # Overlap hides the sync behind the backward pass, never below 0.
    hidden = projection.step_split(dataclasses.replace(w, overlap=1.0),
                                   system, 64)
    assert hidden["sync"] == max(0.0, split["sync"] - 2 / 3 * 0.2)
    assert projection.expected_max(1) == 0
    assert projection.expected_max(2) == pytest.approx(1 / math.sqrt(math.pi))
    assert projection.expected_max(3) == pytest.approx(
        1.5 / math.sqrt(math.pi))


def test_the_needed_network_reaches_the_target_efficiency():
    system = systems.PRESETS["pcie-25gbe"]
    w = bert_large(micro_seconds=0.5, jitter=0.0)
    need = projection.needed_network(w, system, 64, 0.9)
    assert need is not None
    faster = dataclasses.replace(system, nic_bandwidth=need,
                                 intra_bandwidth=1e12)
    assert projection.step_seconds(w, system, 1) / projection.step_seconds(
        w, faster, 64) == pytest.approx(0.9, abs=1e-3)
    # Inside a node no network is needed; a budget latency alone spends
    # has no answer.
    assert projection.needed_network(w, system, 4, 0.9) == 0.0
    tiny = bert_large(micro_seconds=1e-5, update_seconds=0, fixed_seconds=0)
    assert projection.needed_network(tiny, system, 4096, 0.99) is None


def test_time_to_target_follows_the_noise_scale():
    # A run reached its target in 1,000 steps at batch 256, B_noise 1,024:
    # S_min = 1000 / 5 = 200; at batch 4,096, 200 x 1.25 = 250 steps.
    assert projection.time_to_target(2.0, 4096, 1000, 256, 1024) == \
        pytest.approx(500.0)
    # An unbounded noise scale: every batch is small, steps fall as 1 / B.
    assert projection.time_to_target(1.0, 512, 1000, 256, math.inf) == 500
    target = projection.Target(1000, 256, 1024, (512, None))
    rows = projection.project(bert_large(), systems.PRESETS["dgx-a100"],
                              [8, 64], target=target)
    for row in rows:
        low, high = row["time_to_target_band"]
        assert low <= row["time_to_target"] <= high


def test_calibration_returns_the_rows_it_was_given():
    system = systems.PRESETS["dgx-2h"]
    truth = bert_large(jitter=0.0)
    noisy = dataclasses.replace(system, network_efficiency=0.3)
    rows = [calibrate.Row(n, 4, projection.throughput(truth, noisy, 16 * n))
            for n in (1, 2)]
    start = dataclasses.replace(truth, micro_seconds=1.0)
    workload, fitted = calibrate.from_rows(start, system, *rows)
    assert workload.micro_seconds == pytest.approx(0.2, rel=1e-6)
    assert fitted.network_efficiency == pytest.approx(0.3, rel=1e-4)


def test_the_command_prints_a_table_json_and_a_plot(tmp_path, capsys):
    args = ["--parameters", "110e6", "--micro_batch", "32", "--micro_ms",
            "80", "--accumulation", "2", "--gpus", "8,64,512",
            "--system", "dgx-h100", "--noise_scale", "2000",
            "--noise_interval", "1000,inf", "--target_steps", "10000",
            "--target_batch", "256"]
    assert cli.main(args + ["--plot", str(tmp_path / "plan.png")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("dgx-h100: 8 x H100 SXM a node")
    assert len(printed.splitlines()) == 3 + 3
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert cli.main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["gpus"] for r in rows] == [8, 64, 512]
    assert rows[0]["throughput"] > 0


@pytest.mark.parametrize("args,message", [
    (["--micro_batch", "8"], "without --summary, --parameters, --micro_ms "
     "must be given"),
    (["--system", "dgx-z"], "--system 'dgx-z': not a preset"),
    (["--summary", "/nonexistent/summary.json"], "No such file"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_system_file(tmp_path):
    fields = dataclasses.asdict(systems.PRESETS["dgx-a100"])
    fields.update(name="mine", nics_per_node=4)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(fields))
    mine = systems.load(str(path))
    assert mine.network_bandwidth == pytest.approx(4 * 25e9 * 0.9)
    path.write_text(json.dumps(dict(fields, nics=4)))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['nics'\]"):
        systems.load(str(path))


def test_a_runs_sync_gives_its_links_efficiency():
    from planning.workload import RunFacts
    system = dataclasses.replace(systems.PRESETS["pcie-25gbe"],
                                 gpus_per_node=1)
    w = bert_large(parameters=4.4e6, gradient_bytes=4)
    true = dataclasses.replace(system, network_efficiency=0.37)
    sync = collectives.gradient_sync(true, 2, w.gradient_size)
    facts = RunFacts(w, 2, sync, 128, 10, None, None, "grpc")
    assert calibrate.link_from_sync(facts, system).network_efficiency == \
        pytest.approx(0.37, rel=1e-4)
    alone = RunFacts(w, 1, 0.0, 64, 10, None, None, "grpc")
    assert calibrate.link_from_sync(alone, system) is system
