r"""The BERT step on one device: steps per call, XLA, and what the host waits
for.

    python -m benchmarks.gpu.step_calls [--layers 4 --hidden 256 --batch 32]
        [--steps 60] [--variants calls1,calls60,xla_calls1,xla_calls60]

One process, one replica (`MirroredStrategy` on /cpu:0, or /gpu:0 where
there is one), BERT with Google's record features drawn at random (in
memory, so input costs nothing), LAMB. For each variant, after a warm-up
interval (tracing, XLA compilation), one log interval of `--steps` steps:

- examples/s over every step of the interval;
- the time split of the timed steps (run part by part: compute, sync,
  update) and the update's share of a timed step;
- host reads per step: values copied from the device to Python (each a
  wait for the device), counted at TensorFlow's one entry for them.

Variants: `callsN` runs up to N steps per call of the compiled step
(`TrainConfig.steps_per_execution`); `xla_` compiles the per-replica step
and the update with XLA; `bf16_` uses the mixed_bfloat16 policy. The same
command runs on the code before steps per call existed (variants `calls1`
and `xla_calls1` only): that is the "before" of benchmarks/README.md.
"""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops  # counts host reads

from models import bert
from models.bert_config import BertConfig
from tfscale import precision
from tfscale.optim.lamb import Lamb
from tfscale.trainer.loop import TrainConfig, Trainer


class Reads:
    def __init__(self):
        self.count = 0
        original = tf_ops._EagerTensorBase._numpy

        def counted(tensor):
            self.count += 1
            return original(tensor)
        tf_ops._EagerTensorBase._numpy = counted


class Last(keras.callbacks.Callback):
    def on_interval_end(self, step, numbers):
        self.report = dict(numbers)


def make_data(batch, seq, preds, vocab):
    rng = np.random.default_rng(0)
    n = batch * 4
    x = {"input_ids": rng.integers(0, vocab, (n, seq)).astype("int32"),
         "input_mask": np.ones((n, seq), "int32"),
         "segment_ids": np.zeros((n, seq), "int32"),
         "masked_lm_positions": rng.integers(0, seq, (n, preds)).astype("int32")}
    y = {"masked_lm_ids": rng.integers(0, vocab, (n, preds)).astype("int32"),
         "masked_lm_weights": np.ones((n, preds), "float32"),
         "next_sentence_labels": rng.integers(0, 2, (n, 1)).astype("int32")}
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        batch, drop_remainder=True).cache()


def run_variant(name, args, strategy, config_json):
    xla = name.startswith("xla_") or "_xla_" in name
    bf16 = "bf16_" in name
    per_call = int(name.split("calls")[1])
    precision.set_precision("mixed_bfloat16" if bf16 else "float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = bert.make_pretrainer(BertConfig.from_dict(config_json),
                                     args.seq, args.preds)
        optimizer = Lamb(1e-4, weight_decay_rate=0.01)
    fields = dict(global_batch_size=args.batch, jit_compile=xla,
                  precision="mixed_bfloat16" if bf16 else "float32",
                  log_steps=args.steps, timed_steps_per_log=4, verbose=0)
    if "steps_per_execution" in TrainConfig.__dataclass_fields__:
        fields["steps_per_execution"] = per_call
    elif per_call != 1:
        return None
    trainer = Trainer(model=model, optimizer=optimizer,
                      loss_fn=bert.pretraining_loss, strategy=strategy,
                      config=TrainConfig(**fields),
                      metrics=bert.pretraining_metrics())
    data = make_data(args.batch, args.seq, args.preds, config_json["vocab_size"])
    last = Last()
    start = time.perf_counter()
    trainer.fit(lambda context: data, steps_per_epoch=args.steps, epochs=1,
                callbacks=[last])
    warm = time.perf_counter() - start
    counter = Reads()
    try:
        trainer.fit(lambda context: data, steps_per_epoch=args.steps,
                    epochs=2, callbacks=[last])
    finally:
        tf_ops._EagerTensorBase._numpy = _ORIGINAL
    r = last.report
    row = dict(variant=name, examples_per_second=r["examples_per_second"],
               step_ms=1000 * r["step_time"],
               timed_step_ms=1000 * r["timed_step_time"],
               compute_ms=1000 * r["compute"], sync_ms=1000 * r["sync"],
               update_ms=1000 * r["update"],
               host_reads_per_step=counter.count / args.steps,
               first_interval_s=warm)
    return row


_ORIGINAL = tf_ops._EagerTensorBase._numpy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4,
                        help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256,
                        help="hidden size")
    parser.add_argument("--vocab", type=int, default=8000,
                        help="vocabulary size")
    parser.add_argument("--batch", type=int, default=32,
                        help="sequences a batch")
    parser.add_argument("--seq", type=int, default=128,
                        help="tokens a sequence")
    parser.add_argument("--preds", type=int, default=20,
                        help="masked positions a sequence")
    parser.add_argument("--steps", type=int, default=60,
                        help="steps timed in each run")
    parser.add_argument("--variants",
                        default="calls1,calls60,xla_calls1,xla_calls60",
                        help="variants timed, comma-separated (callsN: N "
                             "steps a call; xla_: compiled)")
    parser.add_argument("--json", default=None,
                        help="also write the results to this JSON file")
    args = parser.parse_args()
    config_json = dict(
        vocab_size=args.vocab, hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        intermediate_size=4 * args.hidden, hidden_act="gelu",
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        max_position_embeddings=512, type_vocab_size=2,
        initializer_range=0.02)
    gpus = tf.config.list_logical_devices("GPU")
    strategy = tf.distribute.MirroredStrategy(
        [gpus[0].name if gpus else "/cpu:0"])
    rows = []
    for name in args.variants.split(","):
        row = run_variant(name, args, strategy, config_json)
        if row:
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nBERT {args.layers} layers, hidden {args.hidden}, vocab "
          f"{args.vocab}, seq {args.seq}, batch {args.batch}, "
          f"{strategy.extended.worker_devices[0]}; interval of {args.steps} "
          "steps (4 of them timed)")
    print(f"{'variant':<16}{'examples/s':>11}{'step ms':>9}{'compute':>9}"
          f"{'sync':>7}{'update':>8}{'update %':>9}{'reads/step':>11}")
    for r in rows:
        print(f"{r['variant']:<16}{r['examples_per_second']:>11.1f}"
              f"{r['step_ms']:>9.1f}{r['compute_ms']:>9.1f}{r['sync_ms']:>7.1f}"
              f"{r['update_ms']:>8.1f}"
              f"{100 * r['update_ms'] / max(r['timed_step_ms'], 1e-9):>8.1f}%"
              f"{r['host_reads_per_step']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
