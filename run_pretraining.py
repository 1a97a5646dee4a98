r"""BERT pretraining on one or many workers.

    python run_pretraining.py --input_file='records/train-*.tfrecord' \
        --output_dir=runs/bert --bert_config_file=bert_config.json \
        --train_batch_size=256 --max_seq_length=128 --max_predictions_per_seq=20 \
        --num_train_steps=10000 --num_warmup_steps=1000 --learning_rate=1e-3

Single worker by default; under TF_CONFIG (launch.local, Kubernetes) or
SLURM (`srun`) it runs multi-worker with no other change. Flag names follow
Google's and NVIDIA's run_pretraining.py where the meaning is the same, so
their command lines (and --flagfile files) carry over.

This file is the edge: it alone reads FLAGS, turns them into typed configs and
wires cluster -> data -> model -> Trainer.
"""

import json
import os
import sys
import time

import keras
from absl import app, flags

FLAGS = flags.FLAGS
# Data
flags.DEFINE_string("input_file", None, "Training records: globs or a comma list.")
flags.DEFINE_string("eval_input_file", None, "Evaluation records (optional).")
flags.DEFINE_integer("max_seq_length", 128, "Tokens per record.")
flags.DEFINE_integer("max_predictions_per_seq", 20, "Masked tokens per record.")
flags.DEFINE_integer("shuffle_buffer_size", 10000, "Record shuffle buffer.")
flags.DEFINE_integer("cycle_length", -1, "Files interleaved per worker (-1: auto).")
flags.DEFINE_bool("skip_corrupt_records", False, "Skip and log bad records.")
# Model
flags.DEFINE_string("bert_config_file", None, "Google bert_config.json.")
flags.DEFINE_enum("model", "bert_tiny", ["bert_tiny", "bert_mini", "bert_small",
                                         "bert_medium", "bert_base", "bert_large"],
                  "Preset size when no --bert_config_file is given.")
flags.DEFINE_integer("vocab_size", 30522, "Vocab size for a preset model.")
# Batch and schedule
flags.DEFINE_integer("train_batch_size", 32, "Global batch per optimizer step.")
flags.DEFINE_integer("eval_batch_size", 32, "Global evaluation batch.")
flags.DEFINE_integer("num_accumulation_steps", 1, "Micro-batches per step.")
flags.DEFINE_float("learning_rate", 1e-4, "Peak learning rate.")
flags.DEFINE_integer("num_train_steps", 1000, "Optimizer steps.")
flags.DEFINE_integer("num_warmup_steps", 100, "Linear warmup steps.")
flags.DEFINE_enum("lr_schedule", "polynomial", ["polynomial", "cosine", "constant"],
                  "Decay after warmup.")
flags.DEFINE_enum("lr_scaling", "none", ["none", "linear", "sqrt"],
                  "Scale --learning_rate from --reference_batch_size.")
flags.DEFINE_integer("reference_batch_size", 0, "Batch the rate was tuned at.")
flags.DEFINE_enum("optimizer", "lamb", ["lamb", "adamw", "sgd"], "Optimizer.")
flags.DEFINE_float("weight_decay", 0.01, "Weight decay rate.")
flags.DEFINE_float("clip_global_norm", 1.0, "Global-norm clip (0: none).")
# Numerics and distribution
flags.DEFINE_enum("precision", "float32",
                  ["float32", "mixed_bfloat16", "mixed_float16"], "Precision.")
flags.DEFINE_bool("xla", False, "XLA-compile the forward/backward pass.")
flags.DEFINE_enum("all_reduce_alg", "auto", ["auto", "ring", "nccl"],
                  "Collective implementation.")
flags.DEFINE_integer("bytes_per_pack", 0, "All-reduce pack size (0: one pack).")
flags.DEFINE_float("collective_timeout", 300, "Seconds before a collective fails.")
flags.DEFINE_float("connect_timeout", 120, "Seconds for all workers to join.")
flags.DEFINE_integer("slurm_port_base", 8888, "Port of task 0 on each SLURM node.")
# Output
flags.DEFINE_string("output_dir", None, "Checkpoints, TensorBoard, summary.")
flags.DEFINE_integer("save_checkpoints_steps", 1000, "Checkpoint interval.")
flags.DEFINE_integer("log_steps", 100, "Throughput/loss log interval.")
flags.DEFINE_string("profile_steps", None, "Profile steps 'first,last'.")
flags.DEFINE_integer("max_eval_steps", 100, "Evaluation batches.")
flags.DEFINE_integer("seed", 12345, "Random seed.")
flags.DEFINE_bool("deterministic", False, "Deterministic ops and input order.")


def fail(message: str):
    """One line on stderr, non-zero exit."""
    sys.exit(f"run_pretraining: error: {message}")


def configs_from_flags():
    """FLAGS -> typed configs. Exits naming the flag on a bad value."""
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.tfrecord import TFRecordConfig
    from models import bert_config
    from tfscale.cluster import ClusterConfig
    from tfscale.optim import OptimConfig

    if not FLAGS.input_file:
        fail("--input_file is required")
    if not FLAGS.output_dir:
        fail("--output_dir is required")
    if FLAGS.bert_config_file:
        try:
            model = bert_config.BertConfig.from_json_file(FLAGS.bert_config_file)
        except ValueError as e:
            fail(f"--bert_config_file: {e}")
    else:
        model = bert_config.preset(FLAGS.model, vocab_size=FLAGS.vocab_size)
    profile = None
    if FLAGS.profile_steps:
        try:
            first, last = (int(v) for v in FLAGS.profile_steps.split(","))
            profile = (first, last)
        except ValueError:
            fail(f"--profile_steps must be 'first,last', got {FLAGS.profile_steps!r}")
    try:
        spec = BertRecordSpec(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq)
        records = TFRecordConfig(
            FLAGS.input_file, training=True,
            shuffle_buffer_size=FLAGS.shuffle_buffer_size,
            cycle_length=FLAGS.cycle_length,
            deterministic=FLAGS.deterministic, seed=FLAGS.seed,
            skip_corrupt=FLAGS.skip_corrupt_records)
        optim = OptimConfig(
            optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
            schedule=FLAGS.lr_schedule, warmup_steps=FLAGS.num_warmup_steps,
            total_steps=FLAGS.num_train_steps, weight_decay=FLAGS.weight_decay,
            scaling_rule=FLAGS.lr_scaling,
            reference_batch_size=FLAGS.reference_batch_size)
        cluster = ClusterConfig(all_reduce_alg=FLAGS.all_reduce_alg,
                                bytes_per_pack=FLAGS.bytes_per_pack,
                                collective_timeout_seconds=FLAGS.collective_timeout,
                                connect_timeout_seconds=FLAGS.connect_timeout,
                                slurm_port_base=FLAGS.slurm_port_base)
    except ValueError as e:
        fail(str(e))
    for name in ("train_batch_size", "num_train_steps", "num_accumulation_steps",
                 "log_steps"):
        if getattr(FLAGS, name) < 1:
            fail(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    return dict(model=model, spec=spec, records=records, optim=optim,
                cluster=cluster, profile=profile)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}")
    cfg = configs_from_flags()

    import tensorflow as tf

    from input_pipelines import bert_records, tfrecord
    from models import bert, bert_export
    from tfscale import checkpointing
    from tfscale import cluster as cluster_lib
    from tfscale import precision
    from tfscale.optim import make_optimizer
    from tfscale.preemption import Preempted
    from tfscale.trainer import TrainConfig, Trainer

    try:
        tfrecord.expand_files(FLAGS.input_file)
        if FLAGS.eval_input_file:
            tfrecord.expand_files(FLAGS.eval_input_file)
    except tfrecord.InputError as e:
        fail(f"--input_file: {e}")
    try:
        info = cluster_lib.resolve_cluster(
            slurm_port_base=cfg["cluster"].slurm_port_base)
    except cluster_lib.ClusterError as e:
        fail(str(e))
    if FLAGS.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(FLAGS.seed)
    precision.set_precision(FLAGS.precision)
    try:
        strategy = cluster_lib.make_strategy(info, cfg["cluster"])
    except cluster_lib.ClusterError as e:
        fail(str(e))
    replicas = strategy.num_replicas_in_sync
    divisor = replicas * FLAGS.num_accumulation_steps
    if FLAGS.train_batch_size % divisor:
        fail(f"--train_batch_size {FLAGS.train_batch_size} is not divisible by "
             f"replicas ({replicas}) x --num_accumulation_steps "
             f"({FLAGS.num_accumulation_steps})")

    with strategy.scope():
        model = bert.make_pretrainer(cfg["model"], FLAGS.max_seq_length,
                                     FLAGS.max_predictions_per_seq)
        optimizer = make_optimizer(cfg["optim"], FLAGS.train_batch_size,
                                   model.trainable_variables)
        metrics = bert.pretraining_metrics()
    train_config = TrainConfig(
        global_batch_size=FLAGS.train_batch_size,
        num_accumulation_steps=FLAGS.num_accumulation_steps,
        jit_compile=FLAGS.xla, clip_global_norm=FLAGS.clip_global_norm or None,
        precision=FLAGS.precision,
        checkpoint_dir=os.path.join(FLAGS.output_dir, "checkpoints"),
        save_checkpoints_steps=FLAGS.save_checkpoints_steps,
        log_steps=FLAGS.log_steps, verbose=2)
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=bert.pretraining_loss, strategy=strategy,
                      config=train_config, metrics=metrics,
                      communication_options=cluster_lib.communication_options(
                          cfg["cluster"]))
    dataset_fn = bert_records.make_dataset_fn(
        cfg["records"], cfg["spec"], trainer.per_replica_batch_size)
    if info.is_chief:
        print(run_summary(info, strategy, trainer, cfg, model), flush=True)

    intervals = IntervalLog()
    callbacks = [intervals, keras.callbacks.TerminateOnNaN(),
                 keras.callbacks.TensorBoard(
                     os.path.join(FLAGS.output_dir, "tensorboard"),
                     update_freq=FLAGS.log_steps,
                     profile_batch=cfg["profile"] or 0)]
    start = time.perf_counter()
    try:
        trainer.fit(dataset_fn, steps_per_epoch=FLAGS.num_train_steps,
                    epochs=1, callbacks=callbacks)
    except Preempted as e:
        # Exit 143 after the checkpoint: launchers and schedulers restart us.
        print(f"run_pretraining: {e}", file=sys.stderr, flush=True)
        raise
    except checkpointing.RestoreError as e:
        fail(f"--output_dir: {e}")
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        culprit = tfrecord.find_bad_record(
            tfrecord.expand_files(FLAGS.input_file),
            bert_records.make_parse_fn(cfg["spec"]))
        fail(f"bad input record: {culprit}" if culprit else
             e.message.strip().splitlines()[0])
    elapsed = time.perf_counter() - start
    results = {"steps": int(trainer.step.numpy()),
               "global_batch_size": FLAGS.train_batch_size,
               "num_workers": info.num_workers, "replicas": replicas,
               "wall_seconds": elapsed, "intervals": intervals.rows,
               "checkpoint": trainer.checkpoint_path}
    if FLAGS.eval_input_file:
        eval_records = tfrecord.TFRecordConfig(FLAGS.eval_input_file,
                                               training=False)
        eval_fn = bert_records.make_dataset_fn(
            eval_records, cfg["spec"], max(1, FLAGS.eval_batch_size // replicas))
        results["eval"] = trainer.evaluate(eval_fn, steps=FLAGS.max_eval_steps)
    if info.is_chief:
        results["export"] = bert_export.export(
            model, os.path.join(FLAGS.output_dir, "export"))
        with open(os.path.join(FLAGS.output_dir, "summary.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(final_summary(results), flush=True)


class IntervalLog(keras.callbacks.Callback):
    """Keeps the per-interval loss and throughput the Trainer reports."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        if logs and "interval_loss" in logs:
            self.rows.append({k: float(v) for k, v in logs.items()})


def run_summary(info, strategy, trainer, cfg, model) -> str:
    optim = cfg["optim"]
    params = sum(int(v.numpy().size) for v in model.trainable_variables)
    return "\n".join([
        "tfscale run_pretraining",
        f"  workers {info.num_workers} ({info.source}), replicas "
        f"{strategy.num_replicas_in_sync}, global batch {FLAGS.train_batch_size}"
        f" = {trainer.per_replica_batch_size} per replica x "
        f"{strategy.num_replicas_in_sync} x {FLAGS.num_accumulation_steps} "
        f"accumulation",
        f"  model {FLAGS.bert_config_file or FLAGS.model}: "
        f"{cfg['model'].num_hidden_layers} layers, hidden "
        f"{cfg['model'].hidden_size}, vocab {cfg['model'].vocab_size}, "
        f"{params / 1e6:.2f}M parameters",
        f"  precision {FLAGS.precision}, XLA {'on' if FLAGS.xla else 'off'}, "
        f"all-reduce {FLAGS.all_reduce_alg}",
        f"  optimizer {optim.optimizer}, lr {optim.learning_rate:g} "
        f"({optim.schedule}, warmup {optim.warmup_steps}, scaling "
        f"{optim.scaling_rule}), {FLAGS.num_train_steps} steps"])


def final_summary(results) -> str:
    rows = results["intervals"]
    rate = (sum(r["examples_per_second"] for r in rows) / len(rows)
            if rows else 0.0)
    first = rows[0]["interval_loss"] if rows else float("nan")
    last = rows[-1]["interval_loss"] if rows else float("nan")
    lines = ["tfscale run_pretraining done",
             f"  steps {results['steps']}, {rate:.1f} examples/s (mean of "
             f"log intervals), {results['wall_seconds']:.1f} s",
             f"  loss {first:.4f} (first interval) -> {last:.4f} (last)",
             f"  checkpoint {results['checkpoint']}",
             f"  export {results.get('export')}"]
    if "eval" in results:
        lines.append("  eval " + ", ".join(
            f"{k} {v:.4f}" for k, v in results["eval"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    app.run(main)
