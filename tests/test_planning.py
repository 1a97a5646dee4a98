"""tfscale-plan: the projection checked against published multi-node
tables (calibrated on their smallest rows, predicting the rest), its terms
by hand, and the command's edges."""

import dataclasses
import json
import re
import math
from unittest import mock

import pytest

from planning import calibrate, cli, collectives, frameworks, projection
from planning import published, systems
from planning.workload import Workload

A100 = "nvidia_tf2_bert_large_dgx_a100"
DGX2H = "nvidia_tf2_bert_large_dgx_2h"
HOROVOD_MODELS = ("inception_v3", "resnet_101", "vgg_16")


def golden_checks(within: float = 0.10) -> dict:
    """Each acceptance check of the published tables, with the presets as
    shipped and no calibration but each table's smallest row's time: True
    when it holds."""
    checks = {}
    for name in (A100, DGX2H):
        for nodes, row in published.nvidia_bert(name).items():
            checks[f"{name} {nodes} nodes within {within:.0%}"] = abs(
                row["predicted"] / row["published"] - 1) <= within
    for model in HOROVOD_MODELS:
        result = published.horovod(model)
        checks[f"horovod {model} 16 GPUs within {within:.0%}"] = abs(
            result["predicted_16"] / result["published_16"] - 1) <= within
        checks[f"horovod {model} 512 GPUs' efficiency within "
               f"{within:.0%}"] = abs(
            result["predicted"] / result["published"] - 1) <= within
    return checks


def test_every_published_row_is_predicted_with_the_presets_as_shipped():
    checks = golden_checks()
    assert len(checks) == 14 and all(checks.values()), checks
    # DGX-2H scales worse than DGX A100 at 32 nodes, as published.
    a100 = published.nvidia_bert(A100)
    dgx2h = published.nvidia_bert(DGX2H)
    assert dgx2h[32]["predicted_efficiency"] < a100[32]["predicted_efficiency"]


def test_the_golden_checks_fail_without_the_sync_term():
    with mock.patch.object(projection.collectives, "gradient_sync",
                           lambda *args, **kwargs: 0.0):
        checks = golden_checks()
    assert not all(checks.values()), checks


def test_the_golden_checks_fail_without_the_frameworks_costs():
    # The per-step cost that is not bandwidth (the update's passes, a cost
    # per gradient tensor), modelled as what it is: without it, the rows
    # miss (NVIDIA's 32-node rows by 7-27%, before the network's
    # efficiency was bent to 6-9% to hide it).
    bare = {name: dataclasses.replace(f, update_passes=10.0,
                                      tensor_seconds=0.0)
            for name, f in frameworks.PRESETS.items()}
    with mock.patch.dict(frameworks.PRESETS, bare):
        checks = golden_checks()
    assert not all(checks.values()), checks


def test_a_second_row_calibrates_the_network_to_a_plausible_figure():
    """With the framework's costs in the model, the 2-node row leaves the
    network a wire's efficiency (it was 8.7% without them)."""
    two_rows = published.nvidia_bert(A100, calibration_rows=2)
    assert 0.3 <= two_rows[2]["network_efficiency"] <= 1.0
    for nodes in (8, 32):
        assert abs(two_rows[nodes]["predicted"]
                   / two_rows[nodes]["published"] - 1) <= 0.10


@pytest.mark.parametrize("benchmark", ["bert", "resnet"])
def test_mlperf_time_to_train_from_8_gpus_and_one_other(benchmark):
    """MLPerf Training v3.0, H100: the 8-GPU result and the 512-GPU one fit
    the time-to-train model; it predicts the others (64, 768 and 3,072 or
    3,584 GPUs, per-GPU batches from 96 down to 4) within 25%. Without the
    fixed part of a step (t0 = 0) it cannot."""
    rows = published.mlperf(benchmark)
    assert len(rows) == 5 and 8 in rows
    assert min(r["per_gpu_batch"] for r in rows.values()) <= 16
    errors = {gpus: r["predicted"] / r["published"] - 1
              for gpus, r in rows.items()}
    assert all(abs(e) <= 0.25 for e in errors.values()), errors
    model = rows[8]["model"]
    assert model.t0 > 0 and model.t1 > 0 and model.b_noise > 0
    from planning import time_to_train
    no_fixed = dataclasses.replace(model, t0=0.0)
    system = systems.PRESETS["dgx-h100"]
    misses = [abs(time_to_train.predict(no_fixed, system, g,
                                        r["global_batch"])
                  / r["published"] - 1) > 0.25 for g, r in rows.items()]
    assert any(misses)


# (table, benchmark, the GPU counts fitted, other tables held out too): the
# fitted table's other rows are held out as well. v2.0, v4.0 and v3.1 are
# rounds no preset was tuned on.
HELD_OUT = [
    ("mlperf_training_v3_0_h100", "bert", (8, 512),
     ("mlperf_training_v3_1_h100", "mlperf_training_v3_0_azure_h100")),
    ("mlperf_training_v3_0_h100", "resnet", (8, 512),
     ("mlperf_training_v4_0_h100", "mlperf_training_v3_0_azure_h100")),
    ("mlperf_training_v2_1_a100", "bert", (8, 1024),
     ("mlperf_training_v2_0_a100",)),
    ("mlperf_training_v2_1_a100", "bert", (8, 64), ()),
    ("mlperf_training_v2_1_a100", "bert", (64, 1024), ()),
    ("mlperf_training_v2_0_a100", "bert", (8, 1024),
     ("mlperf_training_v2_1_a100", "mlperf_training_v2_0_azure_a100")),
    ("mlperf_training_v2_0_a100", "resnet", (8, 1024),
     ("mlperf_training_v2_0_azure_a100",)),
    ("mlperf_training_v2_0_a100", "resnet", (8, 64), ()),
    ("mlperf_training_v4_0_h100", "resnet", (8, 2528), ()),
]

# Held-out rows outside their band, each with why (docs/planning.md's table
# says the same): (fitted table, benchmark, fitted GPUs, held-out table,
# GPUs).
OUTSIDE = {
    ("mlperf_training_v2_1_a100", "bert", (8, 1024),
     "mlperf_training_v2_0_a100", 64): "its runs needed 3.22M sequences where v2.1's rerun of the same "
          "64 GPUs at the same batch needed 2.71M (inside the band): "
          "the round's schedule or software, which no fit on another "
          "round sees",
    ("mlperf_training_v2_0_a100", "bert", (8, 1024),
     "mlperf_training_v2_0_azure_a100", 64):
         "its runs needed 3.13M sequences at batch 3,072 (NVIDIA's own "
         "64-GPU result in v2.0: 3.22M; v2.1's rerun: 2.71M) where the fit "
         "through batches 448 and 4,096 gives 2.74M, and its steps took 8% "
         "longer than the fit's: that round's recipe at 3,072, on another "
         "submitter's machines",
}


def _held_out(table, benchmark, fitted, others):
    """(model, system, [(table, GPUs, Result)]) of one HELD_OUT case."""
    from planning import time_to_train
    results, system, parameters, gradient_bytes = published.mlperf_results(
        table, benchmark)
    model = time_to_train.fit_results(system, parameters, gradient_bytes,
                                      [results[g] for g in fitted])
    held = [(table, g, r) for g, r in results.items() if g not in fitted]
    # A result re-listed in another round is held out once, and a fitted
    # one never.
    seen = {(g, r.minutes) for g, r in results.items()}
    for other in others:
        rows, _, _, _ = published.mlperf_results(other, benchmark)
        held += [(other, g, r) for g, r in rows.items()
                 if (g, r.minutes) not in seen]
    return model, system, held


@pytest.mark.parametrize("table,benchmark,fitted,others", HELD_OUT)
def test_time_to_train_holds_out_other_rows_and_rounds(table, benchmark,
                                                        fitted, others):
    """MLPerf results left out of the fit (other GPU counts, other rounds:
    v2.0, v2.1, v3.1, v4.0; another submitter's system: Azure's A100 and
    H100 machines) lie inside their printed band,
    whose floor is the fitted results' run-to-run spread, or OUTSIDE says
    why; a row is marked exactly where its batch or batch per GPU lies
    outside the fitted ones."""
    from planning import time_to_train
    model, system, held = _held_out(table, benchmark, fitted, others)
    assert held and model.spread_measured
    results, _, _, _ = published.mlperf_results(table, benchmark)
    batches = [results[g].global_batch for g in fitted]
    per_gpu = [results[g].per_gpu for g in fitted]
    for source, gpus, result in held:
        row = time_to_train.predict_row(model, system, gpus,
                                        result.global_batch)
        outside = (not min(batches) <= result.global_batch <= max(batches),
                   not min(per_gpu) <= result.per_gpu <= max(per_gpu))
        assert ("batch" in row.extrapolated) == outside[0], (gpus, row)
        assert ("batch per GPU" in row.extrapolated) == outside[1], gpus
        why = OUTSIDE.get((table, benchmark, fitted, source, gpus))
        assert row.minutes.holds(result.minutes) == (why is None), (
            source, gpus, result.minutes, row.minutes)


def test_the_band_floor_is_the_fitted_results_run_to_run_spread():
    """The floor inside the measured range is the largest distance of one
    of the fitted results' runs from its score (v2.1's 8 and 1,024 GPUs:
    3.7% and 5.3-5.4%); without runs, the stated default, which is the median
    of every MLPerf BERT result's spread that published.json holds."""
    import statistics
    from planning import time_to_train
    results, system, parameters, gradient_bytes = published.mlperf_results(
        "mlperf_training_v2_1_a100", "bert")
    assert results[8].spread == pytest.approx(0.0368, abs=1e-4)
    assert results[1024].spread == pytest.approx(0.0535, abs=1e-4)
    model = time_to_train.fit_results(system, parameters, gradient_bytes,
                                      [results[8], results[1024]])
    assert model.floor == pytest.approx(0.0535, abs=1e-4)
    scores = [dataclasses.replace(r, runs=()) for r in
              (results[8], results[1024])]
    bare = time_to_train.fit_results(system, parameters, gradient_bytes,
                                     scores)
    assert not bare.spread_measured
    assert bare.floor == time_to_train.DEFAULT_SPREAD
    spreads = published.load()["mlperf_run_spreads"]
    assert len(spreads["bert"]) == 161
    assert time_to_train.DEFAULT_SPREAD == pytest.approx(
        statistics.median(spreads["bert"]), abs=1e-4)
    assert statistics.median(spreads["resnet"]) < 0.001


def test_the_band_widens_away_from_the_measured_batches():
    from planning import time_to_train
    results, system, parameters, gradient_bytes = published.mlperf_results(
        "mlperf_training_v2_1_a100", "bert")
    model = time_to_train.fit_results(system, parameters, gradient_bytes,
                                      [results[8], results[1024]])
    widths = [time_to_train.examples_band(model, b) for b in
              (2048, 4096, 8192, 16384, 32768)]
    relative = [(w.high - w.low) / w.value for w in widths]
    assert relative[0] == pytest.approx(relative[1]) == pytest.approx(
        2 * model.floor)
    assert relative[1] < relative[2] < relative[3] < relative[4]
    assert [bool(w.extrapolated) for w in widths] == [False, False, True,
                                                       True, True]


def test_each_runs_minutes_set_the_band_from_the_command_line(capsys):
    args = ["--system", "dgx-a100", "--parameters", "336e6",
            "--gradient_dtype", "float16", "--gpus", "64",
            "--train_batch", "3072", "--json", "--results"]
    assert cli.main(args + ["8:448:16.0/17.0/18.0:2456496,"
                            "1024:4096:0.40/0.42/0.44:2782046"]) == 0
    runs = json.loads(capsys.readouterr().out)["rows"][0]["examples"]
    assert cli.main(args + ["8:448:17.0:2456496,"
                            "1024:4096:0.42:2782046"]) == 0
    scores = json.loads(capsys.readouterr().out)["rows"][0]["examples"]
    assert runs[0] == pytest.approx(scores[0])
    # 18.0 is 5.9% from 17.0: the floor; without runs, 7.7%.
    assert runs[2] / runs[0] - 1 == pytest.approx(1 / 17, abs=1e-3)
    assert scores[2] / scores[0] - 1 == pytest.approx(0.0768, abs=1e-4)
    # Runs for one result only: the other's spread is the default's, and
    # the header says which sets the floor.
    assert cli.main(args[:-2] + ["--results", "8:448:16.0/17.0/18.0:2456496,"
                                 "1024:4096:0.42:2782046"]) == 0
    out = capsys.readouterr().out
    assert "+-7.7% (1 of 2 results gave no runs and take 7.7%" in out
    assert cli.main(args[:-2] + ["--results", "8:448:15.0/17.0/19.0:2456496,"
                                 "1024:4096:0.42:2782046"]) == 0
    out = capsys.readouterr().out
    assert ("+-11.8% (the results' run-to-run spread, wider than the 7.7% "
            "the 1 without runs take)") in out
    with pytest.raises(SystemExit) as stop:
        cli.main(args[:-1] + ["--results", "8:448:16.0/x:2456496,"
                              "1024:4096:0.42:2782046"])
    assert stop.value.code == 2
    assert "each run's, M1/M2/..." in capsys.readouterr().err


def test_time_to_train_from_the_command_line(capsys):
    code = cli.main(["--system", "dgx-a100", "--parameters", "336e6",
                     "--gradient_dtype", "float16", "--results",
                     "8:448:16.8821:2456496,1024:4096:0.4209:2782046",
                     "--gpus", "8,64,1024,4096", "--train_batch_per_gpu",
                     "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "a step: t0 15.25 ms fixed + 2.923 ms an example a GPU" in out
    assert "E_min 2,416,516 examples, B_noise 27,079 examples" in out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [line.split()[0] for line in rows] == ["8", "64", "1024", "4096"]
    assert [line.endswith("extrapolated: batch") for line in rows] == [
        True, True, False, True]
    code = cli.main(["--system", "dgx-a100", "--parameters", "336e6",
                     "--gradient_dtype", "float16", "--results",
                     "8:448:16.8821:steps=5484", "--train_batch", "64"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "tfscale-plan: error: --results needs two results or more: one "
        "cannot tell a step's fixed part from its per-example part, nor "
        "how the examples grow with the batch")


def test_two_results_are_named_an_exact_fit_not_a_residual_of_zero(capsys):
    args = ["--system", "dgx-a100", "--parameters", "336e6",
            "--gradient_dtype", "float16", "--gpus", "64",
            "--train_batch", "3072", "--results"]
    two = "8:448:16.8821:2456496,1024:4096:0.4209:2782046"
    assert cli.main(args + [two]) == 0
    out = capsys.readouterr().out
    assert "2 results, 4 terms: an exact fit; nothing checked it" in out
    assert "residual 0.0%" not in out
    assert cli.main(args + [two + ",64:3072:2.942:2700000"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"the fit's largest residual \d+\.\d% over 3 "
                     r"results", out), out
    assert "exact fit" not in out


def test_a_weak_scaling_pair_predicts_other_counts_at_its_batch_per_gpu(
        capsys):
    # The same script on 8 and on 32 GPUs, 16 examples a GPU. Before:
    # refused ("the fixed and the per-example parts cannot be told apart").
    base = ["--system", "dgx-a100", "--parameters", "336e6",
            "--gradient_dtype", "float16", "--results",
            "8:128:60.0:2500000,32:512:16.5:2600000", "--gpus", "8,32,128"]
    assert cli.main(base + ["--train_batch_per_gpu", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["global_batch"] for r in rows] == [128, 512, 2048]
    # Inside the measured range the results themselves come back.
    assert rows[0]["minutes"][0] == pytest.approx(60.0, rel=0.03)
    assert rows[1]["minutes"][0] == pytest.approx(16.5, rel=0.03)
    assert rows[2]["minutes"][0] < rows[1]["minutes"][0]
    assert cli.main(base + ["--train_batch_per_gpu", "16"]) == 0
    assert ("ms of compute at 16 examples a GPU (every result ran that "
            "batch per GPU") in capsys.readouterr().out
    assert cli.main(base + ["--train_batch_per_gpu", "32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tfscale-plan: error: every result ran 16 examples a GPU: they "
        "predict other GPU counts at that batch per GPU "
        "(--train_batch_per_gpu 16); 32 a GPU needs a result at it")


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


def test_a_link_fit_keeps_the_latency_when_the_largest_time_is_noisy():
    # tests/test_hosts.py's sweep on a 160 Mbit/s link with 2 x 2 ms of
    # delay; the 8 MB time 3% off (its noise on a loaded host). Relative
    # errors keep the latency within 5%; unweighted least squares moved it
    # by 2.2 ms (27%).
    sizes = [262144, 1048576, 4194304, 8388608]
    exact = [8e-3 + s / 20e6 for s in sizes]
    for off in (1.03, 0.97):
        seconds = exact[:-1] + [exact[-1] * off]
        latency, bandwidth = collectives.fit_link(sizes, seconds, ranks=2)
        assert latency == pytest.approx(8e-3, rel=0.05)
        assert bandwidth == pytest.approx(20e6, rel=0.05)
    with pytest.raises(ValueError, match="times above zero"):
        collectives.fit_link([1, 2], [0.0, 1.0], 2)


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
                     "tensors": 0.0, "sync": 0.0, "straggler": 0.0}
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
    # Every assumed input named before the rows: the framework, the
    # update and how it was had, the gradient dtype, jitter, overlap,
    # fusion and algorithm.
    head = printed.split("\nGPUs nodes")[0]
    for said in ("framework: tfscale", "update 2.6 ms (estimated: 10 passes",
                 "fixed 0.0 ms", "jitter 0", "overlap 0%",
                 "float32 gradients", "buffer(s) of 64 MB",
                 "algorithm auto", "ZeRO-1 off"):
        assert said in head, (said, head)
    # The system, framework, workload, collectives, NIC and band lines,
    # the table's head and its 3 rows.
    assert len(printed.splitlines()) == 6 + 1 + 3
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert cli.main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["gpus"] for r in rows] == [8, 64, 512]
    assert rows[0]["throughput"] > 0


WORK = ["--parameters", "110e6", "--micro_batch", "32", "--micro_ms", "80"]


@pytest.mark.parametrize("args,message", [
    (["--micro_batch", "8"], "without --summary, --parameters, --micro_ms "
     "(or --measured) must be given"),
    (["--system", "dgx-z"], "--system 'dgx-z': not a preset"),
    (["--summary", "/nonexistent/summary.json"],
     "--summary /nonexistent/summary.json: No such file or directory"),
    (WORK + ["--micro_ms", "-5"], "--micro_ms -5: must be in (0, inf] ms"),
    (WORK + ["--target_steps", "100"], "--target_steps and --target_batch "
     "go together"),
    (WORK + ["--jitter", "-0.5"], "--jitter -0.5: must be in [0, 1]"),
    (WORK + ["--target_efficiency", "1.5"],
     "--target_efficiency 1.5: must be in (0, 1)"),
    (WORK + ["--fusion_mb", "-5"], "--fusion_mb -5: must be in (0, inf]"),
    (WORK + ["--gpus", "8,12,16"], "--gpus 12: not whole nodes of 8 GPUs "
     "(dgx-a100); give 8 or fewer, or multiples of 8 (8 or 16)"),
    (WORK + ["--noise_scale", "100", "--target_steps", "10",
             "--target_batch", "64", "--noise_interval", "200,50"],
     "--noise_interval 200,50: must hold the noise scale (100)"),
    (WORK + ["--measured", "1:abc"], "--measured '1:abc': NODES:"),
    (WORK + ["--deadline", "3"], "--deadline needs --gpu_hour_price"),
    (WORK + ["--framework", "hvd"], "--framework 'hvd': not a preset"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) if message.startswith(
            ("--jitter", "--target_eff", "--fusion", "--measured",
             "--micro_ms")) else \
            _returns(2) as done:
        done.value = cli.main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines()
             if not line.startswith("usage:") and line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


class _returns:
    """A context that checks the main's return value (set on it)."""

    def __init__(self, code):
        self.code, self.value = code, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        assert exc[0] is None and self.value == self.code, self.value


@pytest.mark.parametrize("fields,message", [
    ({}, "empty; a system file holds"),
    ({"intra_bandwidth": 230}, "intra_bandwidth 230 is not in bytes/s "
     "(1e+06-1e+14; 360e9 for 360 GB/s)"),
    ({"nic_latency": 14}, "nic_latency 14 is not in seconds (0-0.1; 14e-6 "
     "for 14 us)"),
])
def test_a_system_file_in_other_units_or_empty_is_named(fields, message,
                                                        tmp_path, capsys):
    path = tmp_path / "mine.json"
    base = dataclasses.asdict(systems.PRESETS["dgx-a100"]) if fields else {}
    path.write_text(json.dumps({**base, **fields}))
    assert cli.main(WORK + ["--system", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: {message}" in err, err


def test_measured_rows_calibrate_from_the_command_line(capsys):
    """NVIDIA's 1- and 2-node DGX A100 rows, with their accumulation: the
    printed calibration, a warning when the network term swallowed what
    the framework's costs are (the tfscale framework), none with NVIDIA's
    framework; and the 32-node row then within 10%."""
    rows = "1:3803.82:32,2:7551.37:16"
    base = ["--parameters", "336e6", "--micro_batch", "312",
            "--accumulation", "1", "--gradient_dtype", "float16",
            "--measured", rows, "--gpus", "256", "--json"]
    assert cli.main(base) == 0
    out = json.loads(capsys.readouterr().out)
    said = " ".join(out["assumptions"])
    assert "network efficiency 8.7% of the NICs' line rate from the 2-node " \
           "row (outside the 30%-100% a wire reaches" in said, said
    assert cli.main(base + ["--framework", "horovod-nvidia-tf2",
                            "--tensors", "398"]) == 0
    out = json.loads(capsys.readouterr().out)
    said = " ".join(out["assumptions"])
    assert "calibrated: micro-batch 652.1 ms from the 1-node row" in said
    assert "outside" not in said
    assert 0.3 <= out["system"]["network_efficiency"] <= 1
    assert out["rows"][0]["throughput"] == pytest.approx(110280.73, rel=0.1)


def test_the_cost_to_target_and_the_cheapest_count_within_a_deadline(
        capsys):
    args = WORK + ["--system", "dgx-h100", "--gpus", "8,64,512",
                   "--noise_scale", "2000", "--target_steps", "20000",
                   "--target_batch", "256", "--gpu_hour_price", "2.5"]
    assert cli.main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for row in rows:
        assert row["cost_to_target"] == pytest.approx(
            row["gpus"] * row["time_to_target"] / 3600 * 2.5)
    # The deadline only the larger counts meet: the cheapest of them.
    hours = sorted(r["time_to_target"] / 3600 for r in rows)
    deadline = (hours[0] + hours[1]) / 2
    meeting = [r for r in rows if r["time_to_target"] / 3600 <= deadline]
    best = min(meeting, key=lambda r: r["cost_to_target"])
    assert cli.main(args + ["--deadline", f"{deadline}"]) == 0
    assert f"cheapest within {deadline:g} h: {best['gpus']} GPUs" in \
        capsys.readouterr().out


def test_a_framework_no_gpu_run_stands_behind_says_so_and_widens_its_band(
        capsys):
    args = WORK + ["--system", "dgx-a100", "--gpus", "8,128", "--json"]
    assert cli.main(args) == 0
    ours = json.loads(capsys.readouterr().out)
    assert any("no multi-node GPU run stands behind its figures yet: the "
               "throughput band reaches horovod-nvidia-tf2's" in line
               for line in ours["assumptions"])
    assert cli.main(args + ["--framework", "horovod-nvidia-tf2"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert not any("stands behind" in line for line in theirs["assumptions"])
    for mine, published_row in zip(ours["rows"], theirs["rows"]):
        assert mine["throughput_band"][0] <= published_row["throughput_band"][0]
        assert mine["throughput_band"][0] < mine["throughput"]


def published_seconds_per_example(name, **match):
    """A published table's time per example per GPU: NVIDIA's TF2 BERT
    throughput tables (1 node) or an MLPerf row (minutes, examples)."""
    table = published.load()[name]
    if "nvidia_tf2" in name:
        system = systems.PRESETS[table["system"]]
        row = next(r for r in table["rows"] if r["nodes"] == 1)
        return system.gpus_per_node / row["throughput"]
    row = next(r for r in table["rows"] if all(r[k] == v for k, v in
                                                match.items()))
    return row["minutes"] * 60 * row["gpus"] / row["examples"]


def test_a_gpu_nobody_measured_gets_its_compute_from_peak_and_bandwidth(
        capsys):
    """Held-out published pairs (the presets were not fitted on them):
    NVIDIA's TF2 BERT-large on a DGX-2H (V100) carried to a DGX A100 lands
    within 15% and inside its band; MLPerf's 8-GPU BERT, A100 (v2.1) to
    H100 (v3.0), ran faster than even the bf16 peaks' ratio allows, below
    the band (docs/planning.md says so)."""
    v100 = published_seconds_per_example("nvidia_tf2_bert_large_dgx_2h")
    a100 = published_seconds_per_example("nvidia_tf2_bert_large_dgx_a100")
    move = systems.ComputeMove(systems.PRESETS["dgx-2h"],
                               systems.PRESETS["dgx-a100"],
                               systems.MATMUL_SHARE)
    measured = a100 / v100
    assert abs(move.ratio / measured - 1) < 0.15, (move.ratio, measured)
    assert move.band[0] <= measured <= move.band[1]
    mlperf_a100 = published_seconds_per_example(
        "mlperf_training_v2_1_a100", benchmark="bert", gpus=8)
    mlperf_h100 = published_seconds_per_example(
        "mlperf_training_v3_0_h100", benchmark="bert", gpus=8)
    h100 = systems.ComputeMove(systems.PRESETS["dgx-a100"],
                               systems.PRESETS["dgx-h100"],
                               systems.MATMUL_SHARE)
    measured = mlperf_h100 / mlperf_a100
    assert measured < h100.flops_ratio < h100.band[1]  # below the band
    # From the command line: the move said, the published 1-node rate
    # inside the row's band.
    assert cli.main(["--parameters", "336e6", "--micro_batch", "60",
                     "--micro_ms", f"{60 * v100 * 1e3:.3f}",
                     "--accumulation", "64", "--gradient_dtype", "float16",
                     "--system", "dgx-a100", "--compute_from", "dgx-2h",
                     "--framework", "horovod-nvidia-tf2", "--gpus", "8",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    low, high = out["rows"][0]["throughput_band"]
    assert low <= 8 / a100 <= high, (low, 8 / a100, high)
    assert any("compute moved from dgx-2h (V100 32GB SXM3) to dgx-a100: 49% "
               "matmul" in line for line in out["assumptions"])
    assert cli.main(WORK + ["--compute_from", "dgx-2h", "--compute_scale",
                            "2"]) == 2
    assert "give one" in capsys.readouterr().err


def test_a_noise_scale_typed_not_measured_widens_the_band_a_factor_3(
        capsys):
    args = WORK + ["--system", "dgx-h100", "--gpus", "8,64",
                   "--noise_scale", "2000", "--target_steps", "20000",
                   "--target_batch", "256", "--vary_batch", "--json"]
    assert cli.main(args) == 0
    typed = json.loads(capsys.readouterr().out)
    assert any("--noise_scale 2000 was given, not measured: x or / 3" in line
               for line in typed["assumptions"])
    assert cli.main(args + ["--noise_interval", f"{2000 / 3},6000"]) == 0
    stated = json.loads(capsys.readouterr().out)
    for a, b in zip(typed["rows"], stated["rows"]):
        assert a["time_to_target_band"] == pytest.approx(
            b["time_to_target_band"])
    low, high = typed["rows"][1]["time_to_target_band"]
    assert high / low > 1.5  # before: the step's spread alone (~1.06)


def test_the_targets_own_batch_needs_no_noise_scale(capsys):
    # 32 examples a GPU: 8 GPUs train at the target's batch 256; the other
    # rows' steps would rest on a noise scale nobody measured. Before: the
    # whole command was refused without --noise_scale.
    args = WORK + ["--system", "dgx-h100", "--gpus", "8,64,512",
                   "--target_steps", "20000", "--target_batch", "256",
                   "--gpu_hour_price", "2.5"]
    assert cli.main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["time_to_target"] == pytest.approx(
        20000 * rows[0]["step_seconds"])
    # The default holds the target's global batch: 64 GPUs take 4
    # examples each (micro-batches of 4), still 20,000 steps.
    assert rows[1]["target_split"] == "batch 256 = 4 x 1 a GPU"
    assert rows[1]["time_to_target"] < rows[0]["time_to_target"]
    # 512 GPUs cannot split 256 examples: that row needs a noise scale.
    assert rows[2]["time_to_target"] is None
    assert rows[2]["cost_to_target"] is None
    assert cli.main(args + ["--deadline", "100"]) == 0
    printed = capsys.readouterr().out
    assert " at batch 256 = 4 x 1 a GPU" in printed
    assert "needs --noise_scale (batch 16384, not the target's 256)" in \
        printed
    # Asked to vary the batch: every other batch needs the noise scale.
    assert cli.main(args + ["--vary_batch", "--json"]) == 0
    varied = json.loads(capsys.readouterr().out)["rows"]
    assert varied[0]["time_to_target"] == pytest.approx(
        rows[0]["time_to_target"])
    assert [r["time_to_target"] for r in varied[1:]] == [None, None]


def test_a_cheapest_count_that_rests_on_the_noise_scale_says_so(capsys):
    # An unbounded noise scale interval: at its ends 512 GPUs are cheapest
    # or 8 are; the line names both rather than one as if it were known.
    args = WORK + ["--system", "dgx-h100", "--gpus", "8,64,512",
                   "--noise_scale", "2000", "--noise_interval", "200,inf",
                   "--target_steps", "20000", "--target_batch", "256",
                   "--gpu_hour_price", "2.5", "--vary_batch"]
    assert cli.main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    # A deadline 8 GPUs meet at the band's fast end and miss at its slow
    # one (where only more GPUs meet it).
    deadline = 1.01 * rows[0]["time_to_target_band"][0] / 3600
    ends = {(cli.cheapest(rows, deadline, which) or {}).get("gpus")
            for which in (0, 1)}
    assert len(ends) > 1 and None not in ends, rows
    assert cli.main(args + ["--deadline", f"{deadline}"]) == 0
    printed = capsys.readouterr().out
    assert "the answer moves between " + ", ".join(
        f"{n} GPUs" for n in sorted(ends | {cli.cheapest(rows, deadline)[
            "gpus"]})) in printed, printed
    # A deadline every row meets at either end: one answer, nothing added.
    far = 10 * max(r["time_to_target_band"][1] for r in rows) / 3600
    assert cli.main(args + ["--deadline", f"{far}"]) == 0
    assert "moves between" not in capsys.readouterr().out


def test_a_cpu_run_projected_onto_gpus_says_so(tmp_path, capsys):
    summary = {"parameters": 4.4e6, "num_accumulation_steps": 1,
               "global_batch_size": 64, "replicas": 2, "steps": 300,
               "device": {"kind": "cpu", "name": "x86_64"},
               "intervals": [{"first": False, "steps": 25, "compute": 0.05,
                              "sync": 0.02, "update": 0.01,
                              "input_wait": 0.0, "step_time": 0.08,
                              "timed_step_time": 0.08}] * 4}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert cli.main(["--summary", str(path), "--gpus", "8"]) == 0
    assert "warning: the run's compute was measured on a CPU" in \
        capsys.readouterr().out
    assert cli.main(["--summary", str(path), "--gpus", "8",
                     "--compute_scale", "0.05"]) == 0
    assert "warning" not in capsys.readouterr().out


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


def test_a_measured_sweep_becomes_the_systems_network(tmp_path, capsys):
    """--link: a sweep between 2 hosts (seconds = latency + size / bus
    bandwidth) sets the nodes' network; the 2-node ring then costs what
    was measured, and more nodes add hops."""
    latency, bandwidth = 2e-3, 25e6
    sizes = [2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24]
    path = tmp_path / "link.json"
    path.write_text(json.dumps({
        "ranks": 2, "workers": 2, "backend": "mpi", "sizes": sizes,
        "seconds": [latency + s / bandwidth for s in sizes]}))
    fitted = cli._link(str(path))
    assert fitted[0] == pytest.approx(latency) and \
        fitted[1] == pytest.approx(bandwidth)
    system = systems.with_link(dataclasses.replace(
        systems.PRESETS["pcie-25gbe"], gpus_per_node=1), *fitted)
    assert collectives.ring(system, 2, 1e6) == pytest.approx(
        latency + 1e6 / bandwidth)
    assert collectives.ring(system, 8, 1e6) > collectives.ring(system, 2,
                                                               1e6)
    assert cli.main(WORK + ["--link", str(path), "--gpus", "8"]) == 0
    assert "link measured" in capsys.readouterr().out
    path.write_text(json.dumps({"sizes": sizes}))
    assert cli.main(WORK + ["--link", str(path)]) == 2
    assert f"{path}: no ['ranks', 'seconds']" in capsys.readouterr().err


def cpu_summary(tmp_path, load=None):
    """A CPU run's summary.json whose intervals vary (jitter 0.2)."""
    intervals = [{"first": False, "steps": 25, "compute": 0.05, "sync": 0.02,
                  "update": 0.01, "input_wait": 0.0, "step_time": t,
                  "timed_step_time": t} for t in (0.06, 0.08, 0.1, 0.08)]
    summary = {"parameters": 4.4e6, "num_accumulation_steps": 1,
               "global_batch_size": 64, "replicas": 2, "steps": 300,
               "device": {"kind": "cpu", "name": "x86_64"},
               "intervals": intervals}
    if load is not None:
        summary["host"] = {"load_average": load, "cores": 2}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    return str(path)


def test_a_cpus_jitter_is_not_carried_onto_gpus_unless_asked(tmp_path,
                                                             capsys):
    path = cpu_summary(tmp_path)
    assert cli.main(["--summary", path, "--gpus", "8,64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workload"]["jitter"] == 0.0
    assert ("jitter: 0 (the run's 0.204 was measured on a CPU and is not "
            "carried onto this system, whose own is not measured; "
            "--carry_jitter keeps it)") in plan["assumptions"], \
        plan["assumptions"]
    assert cli.main(["--summary", path, "--gpus", "8,64", "--json",
                     "--carry_jitter"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["workload"]["jitter"] == pytest.approx(0.204, abs=1e-3)
    assert kept["rows"][1]["split"]["straggler"] > \
        plan["rows"][1]["split"]["straggler"]


def test_a_loaded_hosts_run_is_named_as_such(tmp_path, capsys):
    assert cli.main(["--summary", cpu_summary(tmp_path, load=3.1),
                     "--gpus", "8"]) == 0
    assert ("warning: the run's host was loaded (load average 3.1 on 2 cores "
            "at its end): its timings hold other work") in \
        capsys.readouterr().out
    assert cli.main(["--summary", cpu_summary(tmp_path, load=0.9),
                     "--gpus", "8"]) == 0
    assert "was loaded" not in capsys.readouterr().out


def test_the_header_holds_every_assumption_with_its_unit(capsys):
    assert cli.main(WORK + ["--gpus", "8,16", "--noise_scale", "500",
                            "--target_steps", "1000", "--target_batch", "256",
                            "--gpu_hour_price", "2.5", "--json"]) == 0
    said = "\n".join(json.loads(capsys.readouterr().out)["assumptions"])
    for text in ("latency 3.4 us a hop inside a node, 14 us a hop between "
                 "nodes, 8.4 us a collective",
                 "NIC Gb/s: the line rate a node needs for 90% weak-scaling "
                 "efficiency (--target_efficiency)",
                 "band: compute +-3%, network efficiency +-20%, jitter x or "
                 "/ 2, the noise scale's interval",
                 "cost: GPUs x hours to the target x 2.5 a GPU-hour"):
        assert text in said, said


def test_a_measured_row_beyond_linear_scaling_is_said(capsys):
    assert cli.main(["--parameters", "336e6", "--micro_batch", "312",
                     "--gradient_dtype", "float16", "--system", "dgx-a100",
                     "--measured", "1:3803.82:32,2:7800:16", "--gpus",
                     "8,16"]) == 0
    assert ("warning: the 2-node row is faster a node than the 1-node row "
            "(3,900.0 against 3,803.8 examples/s): beyond linear scaling") \
        in capsys.readouterr().out


def _mllog(path, platform, batch, minutes, converged, samples):
    lines = [("submission_platform", platform, {}, 0),
             ("global_batch_size", batch, {}, 0),
             ("run_start", None, {}, 1000),
             ("eval_accuracy", 0.72, {"epoch_num": samples}, 2000),
             ("run_stop", None, {"status": "success" if converged
                                 else "aborted"}, 1000 + minutes * 60000)]
    with open(path, "w") as f:
        for key, value, meta, ms in lines:
            f.write(":::MLLOG " + json.dumps({
                "key": key, "value": value, "metadata": meta,
                "time_ms": ms}) + "\n")


def test_mlperf_rows_keeps_the_runs_a_score_averages(tmp_path, capsys):
    """MLPerf's score drops the fastest and slowest run (one that did not
    converge counts as the slowest) and averages the rest; the row keeps
    those runs, and --spreads gives their largest distance from it."""
    from benchmarks.planning import mlperf_rows
    folder = tmp_path / "NVIDIA" / "results" / "dgxh100_n8_x" / "bert"
    folder.mkdir(parents=True)
    for i, (minutes, ok) in enumerate([(1.0, True), (1.2, True),
                                       (1.1, True), (0.9, False),
                                       (0.8, True)]):
        _mllog(folder / f"result_{i}.txt", "8xNVIDIA DGX H100", 4608,
               minutes, ok, 2_800_000 + i)
    row = mlperf_rows.row(str(folder), "bert", str(tmp_path))
    assert row["gpus"] == 64 and row["global_batch"] == 4608
    assert row["kept_minutes"] == [1.0, 1.1, 1.2]
    assert row["minutes"] == pytest.approx(1.1)
    assert mlperf_rows.spread(row["kept_minutes"]) == pytest.approx(1 / 11)
    assert mlperf_rows.gpus_of("2xXE8545x4A100-SXM-40GB") == 8
    assert mlperf_rows.gpus_of("XE8545x4A100-SXM-40GB") == 4
    assert mlperf_rows.gpus_of("NVIDIA DGX A100") == 8
    with mock.patch("sys.argv", ["mlperf_rows", str(tmp_path), "--spreads",
                                 "--benchmarks", "bert"]):
        mlperf_rows.main()
    printed = json.loads(capsys.readouterr().out)
    assert printed["results"] == 1
    assert printed["spreads"] == [round(1 / 11, 4)]
    # Bad input: one line naming it, exit 2, never an empty success.
    cut = folder / "result_5.txt"
    cut.write_text(":::MLLOG " + json.dumps(
        {"key": "run_start", "value": None, "metadata": {}, "time_ms": 0}))
    for argv, said in (([str(tmp_path / "nowhere")], "no SUBMITTER/results"),
                       ([str(tmp_path), "--systems", "a100"],
                        "no result folder of"),
                       ([str(tmp_path)], "result_5.txt: no run_start or "
                                         "run_stop line")):
        with mock.patch("sys.argv", ["mlperf_rows", *argv]), \
                pytest.raises(SystemExit) as stop:
            mlperf_rows.main()
        assert stop.value.code == 2
        assert said in capsys.readouterr().err


def test_the_pages_time_to_train_example_prints_what_it_shows(capsys):
    """docs/planning.md's `--results` example, run as written: every line
    the page shows (its "..." stand for lines left out) is in the output,
    as printed."""
    import pathlib
    import shlex
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" /
            "planning.md").read_text()
    blocks = [b.split("\n```", 1)[0] for b in page.split("```\n$ ")[1:]]
    block = next(b for b in blocks if "--results" in b.split("\n...")[0])
    command, shown = block.split("\n...\n", 1)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "tfscale-plan"
    assert cli.main(argv[1:]) == 0
    out = capsys.readouterr().out.splitlines()
    missing = [line for line in shown.splitlines()
               if line != "..." and line not in out]
    assert missing == []
