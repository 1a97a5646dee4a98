"""BERT's step under `--deterministic` with no scatter (`models/gathers.py`).

XLA on a GPU makes a deterministic scatter a loop whose condition the host
reads each iteration: the step ran over 400 times slower (docs/facts.md,
fact 37). A CPU cannot time that, but it can read what XLA is handed: the
step's HLO must hold no `scatter` and no `while`; and the scatter-free
forms must give what the gathers gave (bit for bit where the sums are
exact, as in BERT's step under op determinism here).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from benchmarks.gpu.step_calls import make_data
from models import bert, bert_config, gathers
from tfscale import precision
from tfscale.optim.lamb import Lamb
from tfscale.step.feed import ReplicaFeed
from tfscale.trainer import parts as trainer_parts
from tfscale.trainer.loop import TrainConfig, Trainer


@contextlib.contextmanager
def op_determinism():
    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        tf_config.disable_op_determinism()


def test_take_rows_gives_the_gathers_values_and_a_scatter_free_gradient():
    """Repeated ids, gradients of whole numbers (every sum exact in any
    order): the same rows, the same table gradient as tf.gather's."""
    rng = np.random.default_rng(0)
    table = tf.constant(rng.normal(size=(11, 5)), tf.float32)
    ids = tf.constant(rng.integers(0, 11, (3, 7)), tf.int32)
    dy = tf.constant(rng.integers(-8, 9, (3, 7, 5)), tf.float32)
    results = []
    for take in (tf.gather, gathers.take_rows):
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = take(table, ids)
        results.append((rows.numpy(), tf.convert_to_tensor(
            tape.gradient(rows, table, output_gradients=dy)).numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_take_positions_is_exact_both_ways():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 9, 4)), tf.float32)
    positions = tf.constant([[0, 4, 8], [3, 0, 0]], tf.int32)  # 0: padding
    dy = tf.constant(rng.normal(size=(2, 3, 4)), tf.float32)
    dy = dy * tf.constant([[[1.0], [1.0], [1.0]], [[1.0], [0.0], [0.0]]])
    results = []
    for take in (lambda a, p: tf.gather(a, p, batch_dims=1),
                 gathers.take_positions):
        with tf.GradientTape() as tape:
            tape.watch(x)
            picked = take(x, positions)
        results.append((picked.numpy(),
                        tape.gradient(picked, x, output_gradients=dy).numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_sparse_cross_entropy_is_tensorflows_deterministic_one():
    rng = np.random.default_rng(2)
    logits = tf.constant(rng.normal(size=(6, 10)) * 3, tf.float32)
    labels = tf.constant([0, 9, 3, 3, 5, 1], tf.int32)
    results = []
    with op_determinism():
        for loss in (lambda y, z: tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=z), gathers.sparse_cross_entropy):
            with tf.GradientTape() as tape:
                tape.watch(logits)
                value = loss(labels, logits)
            results.append((value.numpy(),
                            tape.gradient(value, logits).numpy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    bad = gathers.sparse_cross_entropy(tf.constant([-1, 10, 2]),
                                       logits[:3]).numpy()
    assert np.isnan(bad[:2]).all() and np.isfinite(bad[2])


def bert_inputs(batch=4, seq=16, predictions=5, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    x = {"input_ids": rng.integers(0, vocab, (batch, seq)).astype("int32"),
         "input_mask": np.ones((batch, seq), "int32"),
         "segment_ids": rng.integers(0, 2, (batch, seq)).astype("int32"),
         "masked_lm_positions": np.stack([
             rng.choice(seq, predictions, replace=False)
             for _ in range(batch)]).astype("int32")}
    y = {"masked_lm_ids": rng.integers(0, vocab, (batch, predictions)
                                       ).astype("int32"),
         "masked_lm_weights": np.ones((batch, predictions), "float32"),
         "next_sentence_labels": rng.integers(0, 2, (batch, 1)
                                              ).astype("int32")}
    return x, y


TINY = bert_config.preset("bert_tiny", vocab_size=128)


def test_the_scatter_free_bert_ends_where_todays_does():
    """Under op determinism, with dropout: the same loss and every gradient
    bit for bit, the same variables (so the same checkpoints)."""
    x, y = bert_inputs()
    runs = []
    with op_determinism():
        for scatter_free in (False, True):
            keras.utils.set_random_seed(3)
            model = bert.make_pretrainer(TINY, 16, 5,
                                         scatter_free=scatter_free)
            loss_fn = bert.make_pretraining_loss(scatter_free)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            runs.append((float(loss), [v.path for v in model.weights],
                         [tf.convert_to_tensor(g).numpy() for g in grads]))
    (loss, paths, grads), (loss_free, paths_free, grads_free) = runs
    assert loss == loss_free and paths == paths_free
    for path, a, b in zip(paths, grads, grads_free):
        np.testing.assert_array_equal(a, b, err_msg=path)


def step_hlo(scatter_free: bool, policy="mixed_bfloat16",
             device="/cpu:0", config=TINY, batch=8, seq=16,
             predictions=4) -> str:
    """The HLO of BERT's one-program step (one replica, --xla; BERT-tiny
    of 128 words, batch 8 of 16 tokens unless told)."""
    precision.set_precision(policy)
    try:
        keras.utils.set_random_seed(0)
        strategy = tf.distribute.MirroredStrategy([device])
        with strategy.scope():
            model = bert.make_pretrainer(config, seq, predictions,
                                         scatter_free=scatter_free)
            optimizer = Lamb(1e-3, weight_decay_rate=0.01)
            metrics = bert.pretraining_metrics()
        trainer = Trainer(
            model=model, optimizer=optimizer, strategy=strategy,
            loss_fn=bert.make_pretraining_loss(scatter_free),
            metrics=metrics, config=TrainConfig(
                global_batch_size=batch, jit_compile=True,
                compile_update=True, precision=policy, verbose=0))
        feed = ReplicaFeed(strategy, lambda c: make_data(
            batch, seq, predictions, config.vocab_size),
                           num_replicas=1, num_workers=1, worker_index=0)
        trainer._replica_feed = feed  # what fit sets: the step reads it
        with trainer_parts.borrowed(model, trainer.optimizer):
            return trainer._train_step.step_hlo(feed.iterator)
    finally:
        precision.set_precision("float32")


def instructions(hlo: str, kind: str) -> int:
    return sum(f" {kind}(" in line for line in hlo.splitlines())


@pytest.mark.parametrize("device", ["/gpu:0"])
def test_the_deterministic_step_holds_no_scatter_and_no_loop(device):
    """What XLA compiles for a GPU under --deterministic: no scatter, no
    while (on a CPU, `/gpu:0` takes tf.distribute's GPU branch). Today's
    step under op determinism holds six scatters (the embeddings', the
    masked positions', both cross-entropies'): the check can fail."""
    with op_determinism():
        free = step_hlo(True, device=device)
        todays = step_hlo(False, device=device)
    assert instructions(free, "scatter") == 0
    assert instructions(free, "while") == 0
    assert instructions(todays, "scatter") == 6


def test_take_rows_in_blocks_of_the_vocabulary_sums_what_one_one_hot_sums():
    """A table of 5,000 rows (3 blocks of `ONE_HOT_ROWS`): the same
    gradient, bit for bit, as one one-hot over every row, and the gather's
    on whole numbers."""
    rng = np.random.default_rng(4)
    table = tf.constant(rng.normal(size=(5000, 6)), tf.float32)
    ids = tf.constant(rng.integers(0, 5000, (4, 32)), tf.int32)
    ids = tf.concat([ids, [[0, 2047, 2048, 4999] * 8]], 0)  # block edges
    dy = tf.constant(rng.normal(size=(5, 32, 6)), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(table)
        rows = gathers.take_rows(table, ids)
    blocked = tape.gradient(rows, table, output_gradients=dy).numpy()
    one_hot = tf.one_hot(tf.reshape(ids, [-1]), 5000)
    whole = tf.matmul(one_hot, tf.reshape(dy, [-1, 6]),
                      transpose_a=True).numpy()
    np.testing.assert_array_equal(blocked, whole)
    np.testing.assert_array_equal(rows.numpy(), tf.gather(table, ids).numpy())
    whole_numbers = tf.round(dy * 4)
    with tf.GradientTape() as tape:
        tape.watch(table)
        rows = gathers.take_rows(table, ids)
    with tf.GradientTape() as reference:
        reference.watch(table)
        gathered = tf.gather(table, ids)
    np.testing.assert_array_equal(
        tape.gradient(rows, table, output_gradients=whole_numbers).numpy(),
        tf.convert_to_tensor(reference.gradient(
            gathered, table, output_gradients=whole_numbers)).numpy())


def one_hot_bytes(hlo: str) -> list:
    """(bytes, shape) of every array the step's one-hots make (the HLO
    instructions of TensorFlow's OneHot ops), largest first."""
    import re
    sizes = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}
    found = []
    for line in hlo.splitlines():
        if 'op_type="OneHot"' not in line:
            continue
        shape = re.search(r"= (\w+)\[([\d,]*)\]", line)
        if shape and shape.group(1) in sizes:
            dims = [int(d) for d in shape.group(2).split(",") if d]
            found.append((sizes[shape.group(1)] * int(np.prod(dims)),
                          shape.group(1) + str(dims)))
    return sorted(found, reverse=True)


@pytest.mark.slow
def test_the_deterministic_bert_base_step_holds_no_one_hot_over_every_token_and_word():
    """BERT-base (30,522 words), batch 64 of 128 tokens, 20 predictions,
    mixed_bfloat16, the GPU branch: the embeddings' one-hots are 8,192
    tokens x 2,048 rows (64 MiB; one over the vocabulary was 1.0 GB:
    mutation tried), and the largest one-hot of the step is the
    cross-entropy's, the size of the logits it picks from (1,280 x 30,522
    x 4 B = 156 MB): docs/gpus.md states both."""
    base = bert_config.preset("bert_base")
    with op_determinism():
        hlo = step_hlo(True, device="/gpu:0", config=base, batch=64,
                       seq=128, predictions=20)
    found = one_hot_bytes(hlo)
    tokens = 64 * 128
    embeddings = [b for b, shape in found if f"[{tokens}," in shape]
    assert embeddings and max(embeddings) == tokens * gathers.ONE_HOT_ROWS * 4
    logits = 64 * 20 * base.vocab_size * 4
    assert found[0][0] == logits, found[:3]
