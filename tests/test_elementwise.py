"""models/elementwise.py: each hand-written gradient against autodiff of
the same formula in float64, and the bias gradient's accumulation against
TensorFlow's bfloat16 BiasAddGrad."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import elementwise


def autodiff(fn, *inputs, dy):
    """(fn(*inputs), d(sum(fn * dy))/d inputs) by TensorFlow's autodiff."""
    inputs = [tf.constant(v) for v in inputs]
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = fn(*inputs)
        loss = tf.reduce_sum(y * dy)
    return y.numpy(), [g.numpy() for g in tape.gradient(loss, inputs)]


def tanh_gelu(x):
    """Google BERT's `modeling.gelu` with float64 constants (TensorFlow's
    own `tf.nn.gelu` rounds 0.044715 to float32 first)."""
    return 0.5 * x * (1.0 + tf.tanh(np.sqrt(2 / np.pi)
                                    * (x + 0.044715 * tf.pow(x, 3))))


def test_gelu_backward_is_the_derivative_of_the_tanh_form():
    """The hand-written backward (uncompiled, float64) against autodiff of
    the tanh GELU; then the compiled custom gradient against both, within
    XLA's CPU tanh (an approximation: 4e-7 relative in float64)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 96)) * 3  # both tails of tanh
    dy = rng.standard_normal((64, 96))
    want, (want_dx,) = autodiff(tanh_gelu, x, dy=dy)
    np.testing.assert_allclose(elementwise._gelu_forward(x).numpy(), want,
                               rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(
        elementwise._gelu_backward(tf.constant(x), dy).numpy(), want_dx,
        rtol=1e-10, atol=1e-13)
    got, (got_dx,) = autodiff(elementwise.gelu_tanh, x, dy=dy)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-6, atol=1e-8)


def test_layer_norm_and_its_gradients_are_autodiffs_of_keras_layer_norm():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 16, 48)) * 2 + 0.5
    gamma = rng.standard_normal(48) + 1
    beta = rng.standard_normal(48)
    dy = rng.standard_normal((4, 16, 48))
    want, want_grads = autodiff(
        lambda v, g, b: keras.ops.layer_normalization(v, g, b, epsilon=1e-12),
        x, gamma, beta, dy=dy)
    got, got_grads = autodiff(
        lambda v, g, b: elementwise.layer_norm(v, g, b, 1e-12),
        x, gamma, beta, dy=dy)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    for g, w, name in zip(got_grads, want_grads, ("x", "gamma", "beta")):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


def test_layer_norm_in_bfloat16_keeps_float32_statistics():
    """bf16 in and out, float32 inside: as close to the float64 result as
    one bf16 rounding of the output."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 256)) * 4 + 30).astype("float32")
    x16 = tf.cast(x, tf.bfloat16)
    exact = keras.ops.layer_normalization(
        tf.cast(x16, tf.float64), np.ones(256), np.zeros(256),
        epsilon=1e-12).numpy()
    got = elementwise.layer_norm(x16, tf.ones(256), tf.zeros(256), 1e-12)
    assert got.dtype == tf.bfloat16
    np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), exact,
                               rtol=2 ** -8, atol=2 ** -8)


def test_bias_gradient_accumulates_in_float32_where_biasaddgrad_does_not():
    """32,768 rows of bf16: TensorFlow's BiasAddGrad (bf16, what Keras's
    Dense gets) is far off the exact sum on this CPU; the fused float32 sum
    rounds once."""
    rng = np.random.default_rng(3)
    dy = tf.constant(rng.standard_normal((32768, 64)) * 0.01 + 0.003,
                     tf.bfloat16)
    x = tf.zeros((32768, 64), tf.bfloat16)
    bias = tf.zeros(64, tf.bfloat16)
    exact = tf.cast(dy, tf.float64).numpy().sum(0)

    def bias_gradient(add):
        with tf.GradientTape() as tape:
            tape.watch(bias)
            y = add(x, bias)
        return tf.cast(tape.gradient(y, bias, output_gradients=dy),
                       tf.float64).numpy()

    def error(grad):
        return np.abs(grad - exact).max() / np.abs(exact).max()

    ours = error(bias_gradient(elementwise.bias_add))
    stock = error(bias_gradient(tf.nn.bias_add))
    assert ours <= 2 ** -8, ours
    assert ours <= stock, (ours, stock)


def test_bias_add_passes_the_input_gradient_through():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5, 7))
    bias = rng.standard_normal(7)
    dy = rng.standard_normal((3, 5, 7))
    want, want_grads = autodiff(tf.nn.bias_add, x, bias, dy=dy)
    got, got_grads = autodiff(elementwise.bias_add, x, bias, dy=dy)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_grads[0], want_grads[0], rtol=0)
    np.testing.assert_allclose(got_grads[1], want_grads[1], rtol=1e-12)


@pytest.mark.parametrize("head_size", [64, 16])
def test_query_scale_folded_into_the_projection_is_exact(head_size):
    """1/sqrt(head size) is a power of two for 16 and 64: folding it into
    the kernel and bias gives the same bits as scaling the output."""
    from models import bert
    dense = bert.Dense(32, output_scale=head_size ** -0.5)
    plain = keras.layers.Dense(32)
    x = np.random.default_rng(5).standard_normal((4, 24)).astype("float32")
    dense.build((None, 24))
    plain.build((None, 24))
    plain.set_weights(dense.get_weights())
    np.testing.assert_array_equal(dense(x).numpy(),
                                  plain(x).numpy() * head_size ** -0.5)


def test_dropout_backward_draws_the_forward_mask_again():
    """Kept elements are scaled by 1/(1-rate), about 1-rate of them kept;
    the gradient flows exactly through the kept ones (the backward fusion
    draws the same mask from the seed); the same seed, the same mask."""
    rng = np.random.default_rng(6)
    x = tf.constant(rng.standard_normal((64, 512)) + 3.0, tf.float32)
    dy = tf.constant(rng.standard_normal((64, 512)), tf.float32)
    seed = tf.constant([7, 11], tf.int32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = elementwise.dropout(x, 0.25, seed)
    dx = tape.gradient(y, x, output_gradients=dy).numpy()
    kept = y.numpy() != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(y.numpy()[kept], x.numpy()[kept] / 0.75,
                               rtol=1e-6)
    np.testing.assert_allclose(dx, np.where(kept, dy.numpy() / 0.75, 0.0),
                               rtol=1e-6)
    again = elementwise.dropout(x, 0.25, seed).numpy()
    np.testing.assert_array_equal(again, y.numpy())
    other = elementwise.dropout(x, 0.25, tf.constant([7, 12])).numpy()
    assert (other != y.numpy()).mean() > 0.2


def test_bert_dropout_draws_once_per_call_from_its_seed_generator():
    """The layer keeps Keras's seed generator (its state is checkpointed
    with the model): one draw per call, so a restored state repeats the
    masks that followed it."""
    from models import bert
    layer = bert.Dropout(0.5, seed=3)
    x = tf.ones((8, 64))
    state = layer.seed_generator.state.numpy()
    first = layer(x, training=True).numpy()
    second = layer(x, training=True).numpy()
    assert (first != second).any()
    layer.seed_generator.state.assign(state)
    np.testing.assert_array_equal(layer(x, training=True).numpy(), first)
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x)


def bert_step_graph(precision_name):
    """The traced forward and backward of a small BERT in `precision`."""
    from benchmarks.gpu import step_graph
    from models import bert
    from models.bert_config import BertConfig
    from tfscale import precision
    precision.set_precision(precision_name)
    try:
        config = BertConfig(vocab_size=512, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=1,
                            intermediate_size=256)
        model = bert.make_pretrainer(config, 32, 4)
        x, y = step_graph.features(8, 32, 4)
        x["input_ids"] = x["input_ids"] % 512
        y["masked_lm_ids"] = y["masked_lm_ids"] % 512

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(bert.pretraining_loss(
                    y, model(x, training=True)))
            return tape.gradient(loss, model.trainable_variables)
        return tf.function(step).get_concrete_function(x, y).graph
    finally:
        precision.set_precision("float32")


def test_attention_scores_stay_in_the_compute_dtype():
    """bf16: no float32 tensor of the scores' shape [B, heads, T, T] (no
    cast of the scores, no float32 mask or softmax)."""
    graph = bert_step_graph("mixed_bfloat16")
    scores = [op for op in graph.get_operations()
              if op.outputs and op.outputs[0].shape.as_list() == [8, 1, 32, 32]]
    assert scores and any(op.type == "Softmax" for op in scores)
    assert [(op.type, op.name) for op in scores
            if op.outputs[0].dtype != tf.bfloat16] == []


def test_gelu_layer_norm_and_dropout_run_as_xla_fusions():
    """Their forward and backward passes in the traced step are calls of
    XLA-compiled functions (`benchmarks/gpu/step_graph.py` counts each as its
    outputs), not autodiff's op-by-op chains (no Pow, Rsqrt or squared
    difference outside them, and only the pooler's tanh; dropout's uniform
    numbers are TensorFlow's kernel)."""
    from benchmarks.gpu import step_graph
    graph = bert_step_graph("mixed_bfloat16")
    compiled = [step_graph._compiled_function(op)
                for op in graph.get_operations()]
    for piece in ("_gelu_forward", "_gelu_backward", "_layer_norm_forward",
                  "_layer_norm_backward", "_dropout_forward",
                  "_dropout_backward"):
        assert any(piece in name for name in compiled), piece
    loose = [(op.type, op.name) for op in graph.get_operations()
             if op.type in {"Pow", "Tanh", "TanhGrad", "Rsqrt",
                            "SquaredDifference"}
             and "pooler" not in op.name]
    assert loose == []


def test_prediction_stats_are_keras_cross_entropy_and_argmax():
    """The masked-LM metrics' fused statistics against Keras's sparse
    cross-entropy and an argmax, on float32 logits (ties aside)."""
    rng = np.random.default_rng(8)
    logits = tf.constant(rng.standard_normal((6, 5, 300)) * 4, tf.float32)
    labels = tf.constant(rng.integers(0, 300, (6, 5)), tf.int32)
    labels = tf.where(tf.constant(rng.random((6, 5)) < 0.3),
                      tf.argmax(logits, -1, output_type=tf.int32), labels)
    cross_entropy, correct = elementwise.prediction_stats(logits, labels)
    want = keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                        from_logits=True)
    np.testing.assert_allclose(cross_entropy.numpy(), want.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        correct.numpy(),
        (np.argmax(logits.numpy(), -1) == labels.numpy()).astype("float32"))
    assert 0 < correct.numpy().mean() < 1
