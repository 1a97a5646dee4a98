r"""Moving BERT-base's attention heads, forward and backward, on this
machine's first device: TensorFlow's transpose against an XLA-compiled one
(a fusion of its own each way, as `models/elementwise.py` compiles GELU).

    python -m benchmarks.gpu.head_transpose [--batch 256 --seq 128 --heads 12
        --size 64 --dtype bfloat16 --repeats 50]

One layer's moves per step, in the traced step's order: three splits
(query, key, value) and one merge forward, their inverses backward; each
variant a `tf.function` called `--repeats` times after a warm-up, timed to
the host's read of a result (milliseconds per layer and per BERT-base step
of 12 layers). BERT's attention (`models/bert.py`) uses TensorFlow's: on an
H100 the XLA transposes were no faster (benchmarks/README.md), and under
`--xla` both vanish into XLA's fusions.
"""

import argparse
import time

import tensorflow as tf


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256,
                   help="sequences a batch")
    p.add_argument("--seq", type=int, default=128,
                   help="tokens a sequence")
    p.add_argument("--heads", type=int, default=12,
                   help="attention heads")
    p.add_argument("--size", type=int, default=64,
                   help="size of one head")
    p.add_argument("--dtype", default="bfloat16",
                   help="the tensors' dtype")
    p.add_argument("--repeats", type=int, default=50,
                   help="times each measurement is repeated")
    return p.parse_args()


def plain_split(x, heads):
    shape = tf.shape(x)
    return tf.transpose(tf.reshape(x, [shape[0], shape[1], heads, -1]),
                        [0, 2, 1, 3])


def plain_merge(x):
    shape = tf.shape(x)
    return tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [shape[0], shape[2], -1])


_XLA_SPLIT = tf.function(plain_split, jit_compile=True)
_XLA_MERGE = tf.function(plain_merge, jit_compile=True)


def xla_split(x, heads):
    @tf.custom_gradient
    def split(x):
        return _XLA_SPLIT(x, heads), lambda dy: _XLA_MERGE(dy)
    return split(x)


def xla_merge(x):
    heads = x.shape[1]

    @tf.custom_gradient
    def merge(x):
        return _XLA_MERGE(x), lambda dy: _XLA_SPLIT(dy, heads)
    return merge(x)


def layer_moves(split, merge, heads):
    """Three splits and a merge forward, and their gradients (the
    incoming gradients given: nothing but the moves runs)."""
    def run(q, k, v, context, d_heads, d_merged):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v, context])
            outputs = [split(t, heads) for t in (q, k, v)] + [merge(context)]
        return tape.gradient(outputs, [q, k, v, context],
                             output_gradients=[d_heads] * 3 + [d_merged])
    return tf.function(run)


def main():
    args = parse_args()
    width = args.heads * args.size
    shape = [args.batch, args.seq, width]
    q, k, v = (tf.cast(tf.random.normal(shape), args.dtype) for _ in range(3))
    context = tf.cast(tf.random.normal(
        [args.batch, args.heads, args.seq, args.size]), args.dtype)
    device = (tf.config.list_logical_devices("GPU")
              or tf.config.list_logical_devices("CPU"))[0].name
    print(f"{device}, {args.dtype} [{args.batch}, {args.seq}, {args.heads} x "
          f"{args.size}]")
    for name, split, merge in (
            ("TensorFlow's transpose", plain_split, plain_merge),
            ("XLA transposes", xla_split, xla_merge)):
        fn = layer_moves(split, merge, args.heads)
        inputs = (q, k, v, context, context, q)
        fn(*inputs)[0].numpy()
        start = time.perf_counter()
        for _ in range(args.repeats):
            grads = fn(*inputs)
        grads[0].numpy()
        ms = 1000 * (time.perf_counter() - start) / args.repeats
        print(f"  {name}: {ms:.2f} ms per layer, {12 * ms:.1f} ms per "
              "12-layer step")


if __name__ == "__main__":
    main()
