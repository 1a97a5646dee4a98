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
flags.DEFINE_integer("iterations_per_loop", 100,
                     "Steps per host loop: the loss/throughput log interval.")
flags.DEFINE_string("profile_steps", None, "Profile steps 'first,last'.")
flags.DEFINE_integer("max_eval_steps", 100, "Evaluation batches.")
# What to do (Google's names and meaning)
flags.DEFINE_bool("do_train", True,
                  "Train. (Google's default is False; tfscale trains unless "
                  "--do_train=False.)")
flags.DEFINE_bool("do_eval", False,
                  "Evaluate at the end, on --eval_input_file or else on "
                  "--input_file, and write eval_results.txt in --output_dir.")
flags.DEFINE_string("init_checkpoint", None,
                    "Initial model weights when --output_dir has no checkpoint "
                    "yet: a tfscale checkpoint (prefix or directory); step "
                    "and optimizer start fresh.")
# Google's TPU flags: accepted so that Google's command lines parse.
flags.DEFINE_bool("use_tpu", False, "TPUs are not supported (must be False).")
flags.DEFINE_string("tpu_name", None, "Ignored (TPU).")
flags.DEFINE_string("tpu_zone", None, "Ignored (TPU).")
flags.DEFINE_string("gcp_project", None, "Ignored (TPU).")
flags.DEFINE_string("master", None, "Ignored (TPU).")
flags.DEFINE_integer("num_tpu_cores", 8, "Ignored (TPU).")
# NVIDIA DeepLearningExamples names with the same meaning.
flags.DEFINE_bool("use_fp16", False, "NVIDIA: same as --precision=mixed_float16.")
flags.DEFINE_enum("optimizer_type", None, ["lamb", "adam", "adamw", "sgd"],
                  "NVIDIA: same as --optimizer (adam: AdamW, BERT's "
                  "AdamWeightDecay).")
flags.DEFINE_alias("log_steps", "iterations_per_loop")
flags.DEFINE_alias("steps_per_loop", "iterations_per_loop")
flags.DEFINE_alias("enable_xla", "xla")
flags.DEFINE_alias("input_files", "input_file")
flags.DEFINE_alias("warmup_steps", "num_warmup_steps")
flags.DEFINE_alias("model_dir", "output_dir")
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
    if FLAGS.use_tpu:
        fail("--use_tpu=True: TPUs are not supported; tfscale runs on GPUs and "
             "CPUs (drop --use_tpu and the --tpu_* flags)")
    if not (FLAGS.do_train or FLAGS.do_eval):
        fail("at least one of --do_train or --do_eval must be True")
    precision_name = FLAGS.precision
    if FLAGS.use_fp16:
        if FLAGS.precision not in ("float32", "mixed_float16"):
            fail(f"--use_fp16 contradicts --precision={FLAGS.precision}")
        precision_name = "mixed_float16"
    optimizer_name = FLAGS.optimizer
    if FLAGS.optimizer_type:
        # NVIDIA's "adam" is BERT's AdamWeightDecay: decoupled decay, AdamW.
        optimizer_name = {"adam": "adamw"}.get(FLAGS.optimizer_type,
                                               FLAGS.optimizer_type)
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
            optimizer=optimizer_name, learning_rate=FLAGS.learning_rate,
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
                 "iterations_per_loop"):
        if getattr(FLAGS, name) < 1:
            fail(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    return dict(model=model, spec=spec, records=records, optim=optim,
                cluster=cluster, profile=profile, precision=precision_name)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}")
    cfg = configs_from_flags()

    import tensorflow as tf

    from input_pipelines import bert_records, tfrecord
    from models import bert, bert_checkpoints, bert_export
    from tfscale import checkpointing
    from tfscale import cluster as cluster_lib
    from tfscale import precision
    from tfscale.optim import make_optimizer
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
    tf.io.gfile.makedirs(FLAGS.output_dir)  # also when only evaluating
    if FLAGS.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(FLAGS.seed)
    precision.set_precision(cfg["precision"])
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
    checkpoint_dir = os.path.join(FLAGS.output_dir, "checkpoints")
    train_config = TrainConfig(
        global_batch_size=FLAGS.train_batch_size,
        num_accumulation_steps=FLAGS.num_accumulation_steps,
        jit_compile=FLAGS.xla, clip_global_norm=FLAGS.clip_global_norm or None,
        precision=cfg["precision"],
        checkpoint_dir=checkpoint_dir,
        save_checkpoints_steps=FLAGS.save_checkpoints_steps,
        log_steps=FLAGS.iterations_per_loop, verbose=2)
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
                     update_freq=FLAGS.iterations_per_loop,
                     profile_batch=cfg["profile"] or 0)]
    start = time.perf_counter()
    initial = None
    try:
        if FLAGS.init_checkpoint and not tf.train.latest_checkpoint(
                checkpoint_dir):
            initial = load_initial_weights(model, FLAGS.init_checkpoint, tf)
        elif not FLAGS.do_train:
            initial = checkpointing.restore_model(model, checkpoint_dir)
    except (checkpointing.RestoreError,
            bert_checkpoints.GoogleCheckpointError) as e:
        fail(f"--init_checkpoint: {e}" if FLAGS.init_checkpoint else
             f"--do_train=False needs --init_checkpoint or a checkpoint in "
             f"--output_dir: {e}")
    if initial and info.is_chief:
        print(f"tfscale: model weights from {initial}", flush=True)
    if FLAGS.do_train:
        train(trainer, dataset_fn, callbacks, cfg, tf)
    else:
        trainer.step.assign(checkpointing.checkpoint_step(initial))
    elapsed = time.perf_counter() - start
    results = {"steps": int(trainer.step.numpy()),
               "global_batch_size": FLAGS.train_batch_size,
               "num_workers": info.num_workers, "replicas": replicas,
               "wall_seconds": elapsed, "intervals": intervals.rows,
               "checkpoint": trainer.checkpoint_path or initial}
    if FLAGS.do_eval or FLAGS.eval_input_file:
        # Google's script evaluates on --input_file when there is nothing else.
        eval_records = tfrecord.TFRecordConfig(
            FLAGS.eval_input_file or FLAGS.input_file, training=False)
        eval_fn = bert_records.make_dataset_fn(
            eval_records, cfg["spec"], max(1, FLAGS.eval_batch_size // replicas))
        results["eval"] = trainer.evaluate(eval_fn, steps=FLAGS.max_eval_steps)
        if info.is_chief:
            write_eval_results(FLAGS.output_dir, results["steps"],
                               results["eval"])
    if info.is_chief:
        if FLAGS.do_train:
            results["export"] = bert_export.export(
                model, os.path.join(FLAGS.output_dir, "export"))
        with open(os.path.join(FLAGS.output_dir, "summary.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(final_summary(results), flush=True)


def load_initial_weights(model, path: str, tf) -> str:
    """--init_checkpoint: Google's TF1 name-based checkpoint (bert_model.ckpt)
    or a tfscale checkpoint (prefix or directory); model weights only."""
    from models import bert_checkpoints
    from tfscale import checkpointing
    prefix = tf.train.latest_checkpoint(path) if tf.io.gfile.isdir(path) else path
    try:
        name_based = bool(prefix) and bert_checkpoints.is_name_based(prefix)
    except (tf.errors.OpError, ValueError):
        raise checkpointing.RestoreError(f"no checkpoint at {path}") from None
    if name_based:
        return bert_checkpoints.load_google_checkpoint(model, prefix)
    return checkpointing.restore_model(model, path)


def train(trainer, dataset_fn, callbacks, cfg, tf):
    """trainer.fit with run_pretraining's error handling."""
    from input_pipelines import bert_records, tfrecord
    from tfscale import checkpointing
    from tfscale.preemption import Preempted
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


# Google's eval_results.txt keys <- tfscale's evaluation logs.
GOOGLE_EVAL_KEYS = {"loss": "loss", "masked_lm_accuracy": "mlm_accuracy",
                    "masked_lm_loss": "mlm_loss",
                    "next_sentence_accuracy": "nsp_accuracy",
                    "next_sentence_loss": "nsp_loss"}


def write_eval_results(output_dir: str, global_step: int, logs: dict) -> str:
    """`eval_results.txt` as Google's run_pretraining.py writes it."""
    values = {"global_step": global_step}
    values.update({google: logs[ours]
                   for google, ours in GOOGLE_EVAL_KEYS.items()})
    path = os.path.join(output_dir, "eval_results.txt")
    with open(path, "w") as f:
        for key in sorted(values):
            f.write(f"{key} = {values[key]}\n")
    return path


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
        f"  precision {cfg['precision']}, XLA {'on' if FLAGS.xla else 'off'}, "
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
