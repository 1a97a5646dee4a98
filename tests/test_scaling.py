"""The scaling report: its arithmetic, and one real run with 1 and 2 workers."""

import json
import math

import pytest

from benchmarks.scaling import study as scaling


def test_ring_allreduce_bound():
    assert scaling.ring_allreduce_seconds(1000, 1, 10.0) == 0.0
    assert scaling.ring_allreduce_seconds(1000, 2, 10.0) == pytest.approx(100.0)
    assert scaling.ring_allreduce_seconds(1000, 4, 10.0) == pytest.approx(150.0)


def test_variants_parse():
    assert scaling.parse_variant("xla").xla
    assert scaling.parse_variant("bf16").precision == "mixed_bfloat16"
    assert scaling.parse_variant("pack4096").bytes_per_pack == 4096
    assert scaling.parse_variant("batch64").per_worker_batch == 64
    with pytest.raises(ValueError, match="unknown variant"):
        scaling.parse_variant("fp8")


def row(n, eps, mode="weak", sync=0.01):
    return dict(variant="base", mode=mode, num_workers=n,
                examples_per_second=eps, input_wait=0.001, compute=0.02,
                sync=sync, update=0.002, gradient_bytes=4_000_000,
                global_batch_size=32 * n, step_time=0.033)


def test_ring_bound_from_bidirectional_exchanges():
    # 2(N-1) ring steps, each exchanging bytes/N: here 1 ms per 1000 bytes.
    exchange = lambda nbytes: nbytes * 1e-6  # noqa: E731
    assert scaling.ring_exchange_bound_seconds(4000, 1, exchange) == 0.0
    assert scaling.ring_exchange_bound_seconds(4000, 2, exchange) == \
        pytest.approx(2 * 2000e-6)
    assert scaling.ring_exchange_bound_seconds(4000, 4, exchange) == \
        pytest.approx(6 * 1000e-6)


def test_analyze_speedup_efficiency_and_bound():
    seen = []

    def exchange(backend, nbytes):
        seen.append((backend, nbytes))
        return 0.002  # 2 ms per exchange of half the gradients
    rows = scaling.analyze([row(1, 100.0), row(2, 150.0)], bandwidth=1e9,
                           exchange_seconds=exchange)
    assert seen == [("grpc", 2_000_000)]
    assert rows[1]["speedup"] == pytest.approx(1.5)
    assert rows[1]["efficiency"] == pytest.approx(0.75)
    assert rows[1]["ring_bound_seconds"] == pytest.approx(0.004)
    assert rows[1]["sync_vs_bound"] == pytest.approx(0.4)
    assert rows[1]["one_way_bound_seconds"] == pytest.approx(0.004)
    assert rows[1]["allreduce_bandwidth"] == pytest.approx(4e8)
    assert math.isnan(rows[0]["sync_vs_bound"])


def test_each_backend_is_its_own_baseline():
    rows = scaling.analyze(
        [dict(row(1, 100.0), backend="grpc"), dict(row(2, 150.0), backend="grpc"),
         dict(row(1, 110.0), backend="mpi"), dict(row(2, 198.0), backend="mpi")],
        bandwidth=1e9)
    assert [r["efficiency"] for r in rows] == pytest.approx([1, 0.75, 1, 0.9])


@pytest.mark.slow
def test_report_runs_for_one_and_two_mpi_ranks(tmp_path):
    """(The grpc path differs only in the launcher and the link; each
    backend's baseline and bound are checked above; the suite's budget.)"""
    scaling.main(["--model", "materials_mlp", "--workers", "1,2",
                  "--modes", "weak", "--backends", "mpi",
                  "--steps", "12", "--warmup_steps", "5",
                  "--output_dir", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert data["link_bandwidth"] > 1e8  # loopback: well over 100 MB/s
    assert {(r["backend"], r["mode"], r["num_workers"]) for r in rows} == {
        ("mpi", "weak", n) for n in (1, 2)}
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"]
                    and b["backend"] == r["backend"]
                    and b["num_workers"] == 1)
        assert r["speedup"] == pytest.approx(
            r["examples_per_second"] / base["examples_per_second"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["num_workers"])
        # The parts of the timed steps add up to their measured step time.
        assert r["phase_sum"] == pytest.approx(r["timed_step_time"], rel=0.05)
        assert r["gradient_bytes"] == 4 * r["parameters"] + 4
    for two in (r for r in rows if r["num_workers"] == 2):
        assert two["sync"] > 0 and two["ring_bound_seconds"] > 0
    for name in ("report.md", "results.csv", "speedup.png", "breakdown.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "| mpi | base | weak | 2 |" in report


def test_resnet50_workload_reads_real_decoded_images(tmp_path):
    """The resnet50 workload's batches come from JPEG records through the
    image pipeline (the model itself is only built by the workers)."""
    import numpy as np
    import tensorflow as tf
    from benchmarks.pipelines import image_pipeline
    from benchmarks.scaling import worker as scaling_worker
    files = image_pipeline.make_records(str(tmp_path), 10, 2)
    make_model, loss_fn, dataset_fn = scaling_worker.model_and_data(
        "resnet50", 4, files, image_size=48)
    images, labels = next(iter(dataset_fn(None)))
    assert images.shape == (4, 48, 48, 3) and images.dtype == tf.uint8
    assert 0 <= int(tf.reduce_min(labels)) and int(tf.reduce_max(labels)) < 10
    assert float(np.std(images.numpy())) > 10  # decoded pictures, not zeros
    assert "resnet50" in scaling.DEFAULT_BATCH
