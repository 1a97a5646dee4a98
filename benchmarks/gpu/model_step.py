"""The BERT model's own step time on this machine: forward, backward and
the pretraining metrics under one `tf.function`, no optimizer, no
distribution, random in-memory features (what models/ changes move).

    python -m benchmarks.gpu.model_step --bert_config_file=CONFIG \\
        [--precision=float32] [--batch 32 --seq 64 --preds 10]

Prints the fastest of 3 repeats of 10 steps, after one warm-up call.
"""

import argparse
import time

import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bert_config_file", required=True,
                   help="Google's bert_config.json")
    p.add_argument("--precision", default="float32",
                   choices=["float32", "mixed_bfloat16", "mixed_float16"],
                   help="the step's Keras dtype policy")
    p.add_argument("--batch", type=int, default=32, help="examples per step")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--preds", type=int, default=10,
                   help="masked positions per sequence")
    return p.parse_args()


def main():
    args = parse_args()
    import tensorflow as tf
    from models import bert
    from models.bert_config import BertConfig
    from tfscale import precision
    from tfscale.step.losses import unreduced
    precision.set_precision(args.precision)
    config = BertConfig.from_json_file(args.bert_config_file)
    b, t, p = args.batch, args.seq, args.preds
    model = bert.make_pretrainer(config, t, p)
    metrics = bert.pretraining_metrics()
    loss_fn = unreduced(bert.pretraining_loss)
    rng = np.random.default_rng(0)
    ints = lambda high, shape: tf.constant(  # noqa: E731
        rng.integers(0, high, shape), tf.int32)
    x = {"input_ids": ints(config.vocab_size, (b, t)),
         "input_mask": tf.ones((b, t), tf.int32),
         "segment_ids": tf.zeros((b, t), tf.int32),
         "masked_lm_positions": ints(t, (b, p))}
    y = {"masked_lm_ids": ints(config.vocab_size, (b, p)),
         "masked_lm_weights": tf.ones((b, p)),
         "next_sentence_labels": tf.zeros((b, 1), tf.int32)}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_sum(loss_fn(y, pred, None)) / b
        grads = tape.gradient(loss, model.trainable_variables)
        for metric in metrics:
            metric.update_state(y, pred)
        return loss, [tf.convert_to_tensor(g) for g in grads]

    step(x, y)[0].numpy()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(10):
            step(x, y)[0].numpy()
        times.append((time.perf_counter() - start) / 10 * 1e3)
    print(f"{args.precision}, batch {b}, sequence {t}: forward, backward "
          f"and metrics {min(times):.1f} ms per step (fastest of "
          f"{', '.join(f'{v:.1f}' for v in sorted(times))})")


if __name__ == "__main__":
    main()
