"""Gathers whose gradients scatter nothing: BERT's step under
`--deterministic` on GPUs.

The gradient of a gather (an embedding lookup, the masked-LM head's pick of
positions, the label's log-probability in a cross-entropy) is a scatter-add
into zeros. With op determinism on (`tf.config.experimental.
enable_op_determinism`, the jobs' `--deterministic`), TensorFlow's
cross-entropy becomes such a gather too, and XLA on a GPU makes every
scatter deterministic by turning it into a loop over its indices whose
condition the host reads back each iteration: BERT-base's step went from
23.5 ms to over 10 s on an H200 (docs/facts.md, fact 37). These forms give
the same values with no scatter in the step's program (and no loop):

    take_rows(table, ids)        table[ids]; the table's gradient is
                                 one_hot(ids)^T @ dy, a matmul
    take_positions(x, positions) x[b, positions[b]] as a one-hot weighted
                                 sum over the sequence, both ways exact
    sparse_cross_entropy(labels, logits)
                                 -log_softmax(logits)[label] as a one-hot
                                 weighted sum (NaN for a label out of
                                 range, as TensorFlow's)

Exact: each output is one input times 1 plus zeros, each gradient a sum of
the same terms a scatter adds (in another order only where an id repeats:
`take_rows` with two equal ids). On GPUs a float32 matmul runs in
TensorFloat-32, as every other float32 matmul of the step does, unless
`tf.config.experimental.enable_tensor_float_32_execution(False)`.

Cost: `take_rows`'s gradient is 2 x tokens x vocabulary x hidden FLOPs
(BERT-base, batch 64 of 128 tokens: 0.38 TFLOP, against about 4.3 TFLOP
for the rest of the step), its one-hots built a block of `ONE_HOT_ROWS`
rows of the table at a time: tokens x 2,048 in the gradient's dtype (64
MiB in float32 at batch 64; one one-hot over the vocabulary was 1.0 GB),
and the same sums, bit for bit.
"""

import tensorflow as tf

# The rows of the table one one-hot of `take_rows`'s gradient covers: at
# BERT-base's batch 256 of 128 tokens, 32,768 x 2,048 x 4 B = 256 MiB in
# float32 (the whole 30,522-word vocabulary at once: 4.0 GB).
ONE_HOT_ROWS = 2048


@tf.custom_gradient
def take_rows(table, ids):
    """`tf.gather(table, ids)` (rows of a [V, H] table by integer `ids`),
    whose gradient for the table is a one-hot matmul, not a scatter."""
    rows = tf.gather(table, ids)

    def gradient(dy):
        flat_ids = tf.reshape(ids, [-1])
        flat_dy = tf.reshape(dy, [-1, tf.shape(table)[1]])
        vocab = table.shape[0]
        if vocab is None:  # (a static table is the rule: a variable's)
            one_hot = tf.one_hot(flat_ids, tf.shape(table)[0],
                                 dtype=dy.dtype)
            return tf.matmul(one_hot, flat_dy, transpose_a=True), None
        # The table's rows in blocks of ONE_HOT_ROWS: each block's one-hot
        # is tokens x ONE_HOT_ROWS (an id outside the block is a row of
        # zeros), and each gradient element sums the same terms in the
        # same order as one one-hot over the whole vocabulary would.
        blocks = [tf.matmul(tf.one_hot(flat_ids - start,
                                       min(ONE_HOT_ROWS, vocab - start),
                                       dtype=dy.dtype),
                            flat_dy, transpose_a=True)
                  for start in range(0, vocab, ONE_HOT_ROWS)]
        return (blocks[0] if len(blocks) == 1 else tf.concat(blocks, 0)), None
    return rows, gradient


def take_positions(x, positions):
    """`x[b, positions[b, p]]` for x [B, T, H], positions [B, P]: [B, P, H],
    as the sum over T of one_hot(positions) x x (XLA fuses the product into
    the sum: nothing of [B, P, T, H] is stored). Its gradient is the sum
    over P: no gather, no scatter."""
    one_hot = tf.one_hot(positions, tf.shape(x)[1], dtype=x.dtype)
    return tf.reduce_sum(one_hot[:, :, :, None] * x[:, None, :, :], axis=2)


def sparse_cross_entropy(labels, logits):
    """Per-example `-log_softmax(logits)[label]`, as TensorFlow's
    `sparse_softmax_cross_entropy_with_logits` computes it under op
    determinism (a log-softmax, then the label's entry; NaN where the label
    is out of range), the entry picked by a one-hot weighted sum."""
    labels = tf.cast(labels, tf.int32)
    log_probs = tf.nn.log_softmax(logits)
    classes = tf.shape(logits)[-1]
    one_hot = tf.one_hot(labels, classes, dtype=log_probs.dtype)
    cost = -tf.reduce_sum(one_hot * log_probs, axis=-1)
    invalid = tf.logical_or(labels < 0, labels >= classes)
    return tf.where(invalid, tf.constant(float("nan"), cost.dtype), cost)
