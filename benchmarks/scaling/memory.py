"""Memory at scale: sharded optimizer state and recomputed activations.

Two studies, each a table (docs/memory.md and benchmarks/README.md quote
them):

  zero       `run_pretraining` on 2 and 3 CPU workers (launch.local), with
             and without --shard_optimizer_state, for BERT-tiny (the
             records' own config) and BERT-base (110M parameters); from each
             run's summary.json: optimizer-state bytes per worker, every
             worker's peak resident memory (VmHWM), the gradient bytes a
             worker sends per step (the algorithm's count) and the median
             step time of the untimed calls; and the bytes that crossed the
             loopback interface during the run (/proc/net/dev: gRPC's real
             traffic, all workers together).
  recompute  one BERT-base training step (forward, backward, no optimizer)
             in a fresh process per variant, with and without
             recompute_activations: the process's peak resident memory and
             the median step time.

    python -m benchmarks.scaling.memory zero --records 'DIR/train-*.tfrecord' \\
        --bert_config DIR/bert_config.json --out /tmp/memory
    python -m benchmarks.scaling.memory recompute --batch 8 --seq 128
"""

import argparse
import os
import statistics
import shutil
import sys

from benchmarks import harness
from benchmarks.harness import BERT_BASE, REPO



def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


def run_job(workers, shard, config, records, out, steps, batch) -> dict:
    output_dir = os.path.join(out, f"{os.path.basename(config)}-{workers}-"
                                   f"{'shard' if shard else 'plain'}")
    shutil.rmtree(output_dir, ignore_errors=True)
    command = harness.on_workers(workers, harness.python(
               "run_pretraining",
               f"--input_file={records}", f"--output_dir={output_dir}",
               f"--bert_config_file={config}",
               f"--num_train_steps={steps}", "--max_seq_length=32",
               "--max_predictions_per_seq=5",
               f"--train_batch_size={batch}", "--optimizer=lamb",
               "--learning_rate=1e-3", "--num_warmup_steps=2",
               "--iterations_per_loop=4",
               f"--save_checkpoints_steps={10 * steps}",
               f"--shard_optimizer_state={shard}"))
    before = loopback_bytes()
    harness.run(command, what=f"{os.path.basename(config)} on {workers} "
                f"workers, sharded {shard}")
    summary = harness.summary(output_dir)
    summary["loopback_bytes"] = loopback_bytes() - before
    return summary


def zero(args) -> None:
    configs = [(c, n) for c, n in (
        (args.bert_config, "BERT-tiny"),
        (BERT_BASE, "BERT-base"))
        if n in args.models]
    table = harness.Table(
        ["model", "workers", "sharded", "optimizer state / worker (MB)",
         "peak RSS per worker (MB)", "gradient bytes sent / step (MB)",
         "loopback MB / step", "step s", "sync s", "update s"],
        align="lrlrlrrrrr")
    for config, name in configs:
        for workers in args.workers:
            for shard in (False, True):
                s = run_job(workers, shard, config, args.records, args.out,
                            args.steps, args.batch)
                rows = harness.steady(s)
                step, sync, update = (statistics.median(r[k] for r in rows)
                                      for k in ("step_time", "sync",
                                                "update"))
                peaks = "/".join(f"{p / 2**20:.0f}"
                                 for p in s["peak_resident_bytes"])
                table.row(
                    name, workers, "yes" if shard else "no",
                    f"{s['optimizer_state_bytes_per_worker'] / 1e6:.1f}",
                    peaks, f"{s['gradient_bytes_sent_per_step'] / 1e6:.2f}",
                    f"{s['loopback_bytes'] / 1e6 / s['steps']:.2f}",
                    f"{step:.3f}", f"{sync:.3f}", f"{update:.3f}")


RECOMPUTE_STEP = r"""
import json, os, resource, statistics, sys, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf, keras
sys.path.insert(0, {root!r})
from models import bert
from models.bert_config import BertConfig
from tfscale.trainer import memory
config = BertConfig.from_json_file({config!r})
batch, seq, steps, recompute = {batch}, {seq}, {steps}, {recompute}
model = bert.make_pretrainer(config, seq, 20, recompute_activations=recompute)
rng = np.random.RandomState(0)
inputs = {{"input_ids": rng.randint(0, config.vocab_size, (batch, seq)).astype("int32"),
          "input_mask": np.ones((batch, seq), "int32"),
          "segment_ids": np.zeros((batch, seq), "int32"),
          "masked_lm_positions": rng.randint(0, seq, (batch, 20)).astype("int32")}}
labels = {{"masked_lm_ids": rng.randint(0, config.vocab_size, (batch, 20)).astype("int32"),
          "masked_lm_weights": np.ones((batch, 20), "float32"),
          "next_sentence_labels": np.zeros((batch, 1), "int32")}}
@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(bert.pretraining_loss(labels, model(inputs, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    return loss, tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in grads])
step()
before = memory.peak_resident_bytes()
times = []
for _ in range(steps):
    start = time.perf_counter(); [t.numpy() for t in step()]; times.append(time.perf_counter() - start)
print(json.dumps({{"peak": memory.peak_resident_bytes(), "after_build": before,
                  "step": statistics.median(times)}}))
"""


def recompute(args) -> None:
    config = BERT_BASE
    results = {}
    for flag in (False, True):
        code = RECOMPUTE_STEP.format(root=REPO, config=config,
                                     batch=args.batch, seq=args.seq,
                                     steps=args.steps, recompute=flag)
        results[flag] = harness.last_json(harness.run(
            [sys.executable, "-c", code],
            what=f"BERT-base step, recompute_activations={flag}"))
    print(f"BERT-base, batch {args.batch}, seq {args.seq}, {args.steps} "
          "steps after one warm-up (forward + backward)")
    table = harness.Table(["recompute_activations", "peak RSS (MB)",
                           "step s"])
    for flag, r in results.items():
        table.row("yes" if flag else "no", f"{r['peak'] / 2**20:.0f}",
                  f"{r['step']:.2f}")
    plain, again = results[False], results[True]
    print(f"peak ratio {again['peak'] / plain['peak']:.2f}, step-time "
          f"ratio {again['step'] / plain['step']:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="study", required=True)
    z = sub.add_parser("zero")
    z.add_argument("--records", required=True,
                   help="BERT records to train on (a glob)")
    z.add_argument("--bert_config", required=True,
                   help="BERT config JSON of the first model")
    z.add_argument("--out", default="/tmp/tfscale-memory",
                   help="folder for the runs and the report")
    z.add_argument("--workers", type=int, nargs="+", default=[2, 3],
                   help="worker counts")
    z.add_argument("--steps", type=int, default=12,
                   help="steps a run")
    z.add_argument("--models", nargs="+", default=["BERT-tiny", "BERT-base"],
                   help="models to measure")
    z.add_argument("--batch", type=int, default=12,
                   help="global batch a step")
    r = sub.add_parser("recompute")
    r.add_argument("--batch", type=int, default=8,
                   help="global batch a step")
    r.add_argument("--seq", type=int, default=128,
                   help="tokens a sequence")
    r.add_argument("--steps", type=int, default=3,
                   help="steps a run")
    args = parser.parse_args(argv)
    (zero if args.study == "zero" else recompute)(args)


if __name__ == "__main__":
    main()
