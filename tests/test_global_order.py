"""The same run at any scale, on the real path: run_pretraining.py through
launch.local, BERT without dropout on shuffled records made by the writer,
--deterministic. 1 worker x 6 accumulation steps, 2 x 3 and 3 x 2 end at the
same weights (within float summation order), and a run cut at step 6 on 3
workers and resumed on 2 ends there too: the input position is a global
record position, restored in O(1) on any worker count.

The same runs hold the gradient noise scale's promise: its estimate comes
from the same 6 micro-batches per step on every worker count (the global
order), so 1, 2 and 3 workers report the same B_simple and its moving
averages, in the checkpoint, continue across the resume. (The same global batches on 1-8 workers and
resumes from 2 on 1, 3 and 4 are counted record by record in
test_record_order.py; 2 -> 1 -> 2 workers resume in test_multiworker.py.)

(Record-level promises, every record once per epoch and the same ids in
every global batch for 1-8 workers, are counted in test_record_order.py on
the same pipelines.)
"""

import json
import shutil

import numpy as np
import pytest

from tests.test_pretraining import pretrain_args, run_pretraining

pytestmark = pytest.mark.slow
STEPS, CUT, GLOBAL_BATCH = 12, 6, 24  # 288 records: past one epoch
MICRO_BATCHES = 6  # per step: workers x accumulation steps, 4 records each


def args(corpus, out, workers, *extra):  # noqa: F811
    return pretrain_args(corpus, out, STEPS, f"--bert_config_file={corpus}/"
                         "no_dropout.json", f"--train_batch_size={GLOBAL_BATCH}",
                         f"--num_accumulation_steps={MICRO_BATCHES // workers}",
                         f"--save_checkpoints_steps={CUT}", "--log_steps=6",
                         # A window of 10 steps: warming up at step 6, a
                         # value with its interval at step 12.
                         "--noise_scale_decay=0.9",
                         "--deterministic", "--seed=11", *extra)


def state(out, step=STEPS):
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(out / "checkpoints" / f"ckpt-{step}"))
    return {key: reader.get_tensor(key)
            for key, dtype in reader.get_variable_to_dtype_map().items()
            if dtype != tf.string and "save_counter" not in key
            and not key.startswith("metrics/")}


def cut_at(source, target, step):
    """`target` holds `source`'s checkpoint at `step` as its latest: the
    state of a run stopped there."""
    directory = target / "checkpoints"
    directory.mkdir(parents=True)
    for path in (source / "checkpoints").glob(f"ckpt-{step}.*"):
        shutil.copy(path, directory)
    (directory / "checkpoint").write_text(
        f'model_checkpoint_path: "ckpt-{step}"\n'
        f'all_model_checkpoint_paths: "ckpt-{step}"\n')


def noise_scale(out):
    """The run's gradient noise scale numbers (summary.json)."""
    summary = json.loads((out / "summary.json").read_text())["noise_scale"]
    return {key: summary[key] for key in ("b_simple", "gradient_squared",
                                          "trace_sigma", "steps_averaged")}


def assert_reported(out, output, b_simple):
    """Where users look: the log line, the closing sentence, TensorBoard
    and summary.json's intervals (per group too)."""
    import re
    from tensorboard.backend.event_processing import event_accumulator
    assert re.search(r"step 6: loss .*; noise scale warming up \(6/10 steps\)",
                     output), output[-3000:]
    assert re.search(r"step 12: loss .*; noise scale [\d.]+ \(95% [\d,]+-"
                     r"[\d,]+; batch/noise ", output), output[-3000:]
    assert (f"gradient noise scale: B_simple {b_simple:,.0f} examples, 95% "
            "interval ") in output
    assert f"at step {STEPS}); this run's global batch" in output
    last = json.loads((out / "summary.json").read_text())["intervals"][-1]
    assert last["gradient_noise_scale"] == pytest.approx(b_simple)
    assert (last["gradient_noise_scale_low"] < b_simple
            < last["gradient_noise_scale_high"])
    assert last["critical_batch_ratio"] == pytest.approx(GLOBAL_BATCH / b_simple)
    assert {"gradient_noise_scale/embeddings", "gradient_noise_scale/encoder",
            "gradient_noise_scale/head"} <= set(last)
    events = event_accumulator.EventAccumulator(str(out / "tensorboard" /
                                                    "train"))
    events.Reload()
    tags = set(events.Tags()["scalars"]) | set(events.Tags()["tensors"])
    assert {"batch_gradient_noise_scale", "batch_critical_batch_ratio",
            "batch_gradient_noise_scale_low", "batch_gradient_noise_scale_high",
            "batch_gradient_noise_scale/encoder"} <= tags, tags


def assert_same_run(reference, other, label):
    assert sorted(reference) == sorted(other)
    for key, value in reference.items():
        np.testing.assert_allclose(other[key], value, rtol=1e-4, atol=2e-6,
                                   err_msg=f"{label}: {key}")


def test_one_to_three_workers_and_a_resume_across_counts_end_at_the_same_weights(
        corpus, tmp_path):  # noqa: F811
    config = json.loads((corpus / "bert_config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (corpus / "no_dropout.json").write_text(json.dumps(config))
    runs = {}
    outputs = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        _, outputs[workers] = run_pretraining(workers, args(corpus, out,
                                                            workers))
        runs[workers] = out
    reference = state(runs[1])
    assert int(reference["input_position/.ATTRIBUTES/VARIABLE_VALUE"]) == (
        STEPS * GLOBAL_BATCH)
    noise = noise_scale(runs[1])
    assert noise["steps_averaged"] == STEPS and noise["b_simple"] > 0
    assert_reported(runs[1], outputs[1], noise["b_simple"])
    for workers in (2, 3):
        assert_same_run(reference, state(runs[workers]), f"{workers} workers")
        assert noise_scale(runs[workers]) == pytest.approx(noise, rel=1e-3)
    # Negative control: the same comparison fails when the records are
    # dealt out per worker (the order then depends on the worker count).
    sharded = tmp_path / "sharded2"
    run_pretraining(2, args(corpus, sharded, 2, "--input_order=sharded"))
    with pytest.raises(AssertionError):
        assert_same_run(reference, state(sharded), "2 workers, sharded")
    for before, after in ((3, 2),):
        out = tmp_path / f"r{before}{after}"
        cut_at(runs[before], out, CUT)
        _, output = run_pretraining(after, args(corpus, out, after))
        assert (f"at step {CUT}; input position restored (global record "
                f"{CUT * GLOBAL_BATCH}, the same order on any worker count)"
                in output)
        assert_same_run(reference, state(out), f"{before} -> {after} workers")
        assert noise_scale(out) == pytest.approx(noise, rel=1e-3)
