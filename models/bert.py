"""BERT for pretraining in Keras 3: encoder, masked-LM and next-sentence heads.

Inputs are Google's record features (`input_ids`, `input_mask`,
`segment_ids`, `masked_lm_positions`); outputs are float32 logits
`{"mlm_logits": [B, P, V], "nsp_logits": [B, 2]}`. `BertPretrainer.encoder`
is a `BertEncoder` (embeddings, transformer layers, pooler) that can be saved
and loaded on its own for fine-tuning. Mixed-precision safe: layers compute
in the policy's dtype, attention included (1/sqrt(head size) folded into the
query projection, mask and softmax in the compute dtype, as NVIDIA's BERT
does); layer norm statistics, the output logits and the losses are float32.
GELU, layer norm and the bias gradients are `models/elementwise.py`'s (one
XLA fusion each way, float32-accumulated bias gradients). Variable paths
contain `layer_norm` and `bias` where BERT's recipe excludes them from
weight decay.

`scatter_free` (the jobs' `--deterministic`): the embeddings, the masked-LM
head's gather and the loss take `models/gathers.py`'s forms, whose gradients
hold no scatter (deterministic XLA on a GPU runs a scatter as a loop); the
same values, the same variables.
"""

import functools

import keras
import tensorflow as tf
from keras import layers, ops

from models import elementwise, gathers
from models.bert_config import BertConfig


def _init(config: BertConfig):
    return keras.initializers.TruncatedNormal(stddev=config.initializer_range)


def gelu_tanh(x):
    """Google BERT's `gelu` (`modeling.gelu`): the tanh approximation,
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Keras's default `gelu`
    is the exact erf form, which a Google checkpoint was not trained with."""
    return elementwise.gelu_tanh(x)


class Dense(layers.Dense):
    """Keras's `Dense` (same variables) whose bias gradient accumulates in
    float32 (`elementwise.bias_add`); `output_scale` multiplies the output,
    folded into the kernel and bias (exact for a power of two)."""

    def __init__(self, units, output_scale=None, **kwargs):
        super().__init__(units, **kwargs)
        self.output_scale = output_scale

    def get_config(self):
        return {**super().get_config(), "output_scale": self.output_scale}

    def call(self, inputs, training=None):
        kernel, bias = self.kernel, self.bias
        if self.output_scale is not None:
            kernel = kernel * self.output_scale
            bias = bias * self.output_scale
        x = ops.matmul(inputs, ops.cast(kernel, self.compute_dtype))
        x = elementwise.bias_add(x, ops.cast(bias, self.compute_dtype))
        return self.activation(x)


class LayerNorm(layers.LayerNormalization):
    """Keras's `LayerNormalization` over the last axis (same variables),
    float32 statistics, one fusion each way (`elementwise.layer_norm`)."""

    def __init__(self, epsilon=1e-12, **kwargs):
        super().__init__(epsilon=epsilon, **kwargs)

    def call(self, inputs):
        outputs = elementwise.layer_norm(
            ops.cast(inputs, self.compute_dtype),
            ops.convert_to_tensor(self.gamma),
            ops.convert_to_tensor(self.beta), self.epsilon)
        return outputs


class Embedding(layers.Embedding):
    """Keras's `Embedding` (the same variable); `scatter_free`: the table's
    gradient is a one-hot matmul (`gathers.take_rows`), not a scatter."""

    def __init__(self, *args, scatter_free=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.scatter_free = scatter_free

    def call(self, inputs):
        if not self.scatter_free:
            return super().call(inputs)
        # (A tensor, not the variable: the custom gradient is the
        # table's read's.)
        table = tf.identity(ops.convert_to_tensor(self.embeddings))
        rows = gathers.take_rows(table, ops.cast(inputs, "int32"))
        return ops.cast(rows, self.compute_dtype)


def _activation(name):
    # Google's "gelu" and Hugging Face's "gelu_new" are both the tanh form.
    return {"gelu": gelu_tanh, "gelu_new": gelu_tanh,
            "relu": keras.activations.relu, "tanh": keras.activations.tanh}[name]


class Dropout(layers.Dropout):
    """Keras's `Dropout` (the same seed generator, one draw per call) as
    one fusion each way (`elementwise.dropout`; `bits=16`: its masks from
    16 random bits an element)."""

    def __init__(self, rate, bits: int = 32, **kwargs):
        super().__init__(rate, **kwargs)
        self.bits = bits

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        seed = ops.cast(ops.mod(self.seed_generator.next(), 2 ** 31 - 2),
                        "int32")
        return elementwise.dropout(inputs, self.rate, seed, bits=self.bits)


class SelfAttention(layers.Layer):
    """Multi-head self-attention in the compute dtype: the query comes out
    of its projection already scaled by 1/sqrt(head size), and the mask
    bias and softmax take the scores as they are (TensorFlow's GPU softmax
    accumulates a bfloat16 or float16 row in float32)."""

    def __init__(self, config: BertConfig, dropout_bits: int = 32,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        init = _init(config)
        hidden = config.hidden_size
        self.query = Dense(hidden, kernel_initializer=init, name="query",
                           output_scale=self.head_size ** -0.5)
        self.key = Dense(hidden, kernel_initializer=init, name="key")
        self.value = Dense(hidden, kernel_initializer=init, name="value")
        self.output_dense = Dense(hidden, kernel_initializer=init,
                                  name="output")
        self.dropout = Dropout(config.attention_probs_dropout_prob,
                               bits=dropout_bits)

    def _heads(self, x):
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (batch, length, self.num_heads, self.head_size))
        return ops.transpose(x, (0, 2, 1, 3))

    def call(self, x, mask_bias, training=False):
        q = self._heads(self.query(x))
        k = self._heads(self.key(x))
        v = self._heads(self.value(x))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
        probs = ops.softmax(scores + ops.cast(mask_bias, scores.dtype),
                            axis=-1)
        probs = self.dropout(probs, training=training)
        context = ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))
        batch, length = ops.shape(context)[0], ops.shape(context)[1]
        context = ops.reshape(context, (batch, length,
                                        self.num_heads * self.head_size))
        return self.output_dense(context)


class TransformerLayer(layers.Layer):
    """Post-layer-norm transformer block, as in the original BERT."""

    def __init__(self, config: BertConfig, dropout_bits: int = 32, **kwargs):
        super().__init__(**kwargs)
        init = _init(config)
        self.attention = SelfAttention(config, dropout_bits=dropout_bits,
                                       name="attention")
        self.attention_dropout = Dropout(config.hidden_dropout_prob,
                                         bits=dropout_bits)
        self.attention_layer_norm = LayerNorm(name="attention_layer_norm")
        self.intermediate = Dense(
            config.intermediate_size, activation=_activation(config.hidden_act),
            kernel_initializer=init, name="intermediate")
        self.output_dense = Dense(config.hidden_size, kernel_initializer=init,
                                  name="output")
        self.output_dropout = Dropout(config.hidden_dropout_prob,
                                      bits=dropout_bits)
        self.output_layer_norm = LayerNorm(name="output_layer_norm")

    def call(self, x, mask_bias, training=False):
        attended = self.attention(x, mask_bias, training=training)
        x = self.attention_layer_norm(
            x + self.attention_dropout(attended, training=training))
        hidden = self.output_dense(self.intermediate(x))
        return self.output_layer_norm(
            x + self.output_dropout(hidden, training=training))


# What the encoder reads (Google's record feature names).
FEATURES = ("input_ids", "input_mask", "segment_ids")


def _dummy_inputs(max_seq_length: int) -> dict:
    return {
        "input_ids": ops.zeros((1, max_seq_length), "int32"),
        "input_mask": ops.ones((1, max_seq_length), "int32"),
        "segment_ids": ops.zeros((1, max_seq_length), "int32"),
    }


class BertEncoder(keras.Model):
    """Embeddings, the transformer stack and the pooler: what fine-tuning
    starts from.

    Transformer layers are attributes (`layer_0`, `layer_1`, ...), never a
    Python list: Keras tracks list members, but TensorFlow's checkpoint object
    graph does not see them (docs/facts.md, fact 14), so a `tf.train.Checkpoint`
    of a model holding its layers in a list silently lacks their weights.

    Call: `{"input_ids", "input_mask", "segment_ids"}` ->
    `(sequence_output [B, T, H], pooled_output [B, H])`.

    `recompute_activations`: in training, each transformer layer keeps only
    its input for the backward pass and runs its forward again there
    (`recomputed`): activation memory of one layer instead of all, for
    about one more forward pass.

    `scatter_free`: no gradient of the embeddings is a scatter (the word and
    type tables' are one-hot matmuls, the positions' a slice's).
    `dropout_bits`: 32, or 16 (`Dropout`'s masks from 16 random bits).
    """

    def __init__(self, config: BertConfig, recompute_activations=False,
                 scatter_free=False, dropout_bits=32, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.recompute_activations = recompute_activations
        self.scatter_free = scatter_free
        init = _init(config)
        hidden = config.hidden_size
        self.word_embeddings = Embedding(
            config.vocab_size, hidden, embeddings_initializer=init,
            name="word_embeddings", scatter_free=scatter_free)
        self.position_embeddings = layers.Embedding(
            config.max_position_embeddings, hidden,
            embeddings_initializer=init, name="position_embeddings")
        self.type_embeddings = Embedding(
            config.type_vocab_size, hidden, embeddings_initializer=init,
            name="type_embeddings", scatter_free=scatter_free)
        self.embedding_layer_norm = LayerNorm(name="embedding_layer_norm")
        self.embedding_dropout = Dropout(config.hidden_dropout_prob,
                                         bits=dropout_bits)
        for i in range(config.num_hidden_layers):
            setattr(self, f"layer_{i}",
                    TransformerLayer(config, dropout_bits=dropout_bits,
                                     name=f"layer_{i}"))
        self.pooler = Dense(hidden, activation="tanh",
                            kernel_initializer=init, name="pooler")

    @property
    def transformer_layers(self) -> list:
        return [getattr(self, f"layer_{i}")
                for i in range(self.config.num_hidden_layers)]

    def call(self, inputs, training=False):
        missing = [k for k in FEATURES if k not in inputs]
        if missing:
            raise ValueError(
                f"the encoder takes Google's features {FEATURES}; these "
                f"inputs lack {missing} (they hold {sorted(inputs)}; Model "
                "Garden's input_word_ids, input_mask, input_type_ids are "
                "input_ids, input_mask, segment_ids)")
        input_ids = inputs["input_ids"]
        length = ops.shape(input_ids)[1]
        if self.scatter_free:
            # The first `length` rows: a slice, whose gradient is a pad.
            table = self.position_embeddings
            if not table.built:
                table.build((1, length))
            positions = ops.cast(ops.expand_dims(table.embeddings[:length], 0),
                                 table.compute_dtype)
        else:
            positions = self.position_embeddings(
                ops.expand_dims(ops.arange(length), 0))
        x = (self.word_embeddings(input_ids) + positions +
             self.type_embeddings(inputs["segment_ids"]))
        x = self.embedding_dropout(self.embedding_layer_norm(x),
                                   training=training)
        # Padding gets a large negative bias before the softmax.
        mask = ops.cast(inputs["input_mask"], "float32")
        mask_bias = (1.0 - mask[:, None, None, :]) * -10000.0
        for layer in self.transformer_layers:
            if training and self.recompute_activations:
                x = recomputed(layer, x, mask_bias)
            else:
                x = layer(x, mask_bias, training=training)
        return x, self.pooler(x[:, 0])


def recomputed(layer, x, mask_bias):
    """`layer(x, mask_bias, training=True)` under `tf.recompute_grad`: its
    activations are not kept for the backward pass, which runs the layer
    again. Its dropout seed generators are set back to their states at
    the call before each run, so the backward's forward draws the same
    masks (a Keras `SeedGenerator` moves on at every draw) and the states
    end where one plain call leaves them."""
    states = [v for v in layer.variables if "seed_generator_state" in v.path]

    @tf.recompute_grad
    def run(x, mask_bias, *start):
        # (The states at the call are inputs: recompute_grad keeps its
        # inputs for the backward pass, which reads them, not the states.)
        for state, value in zip(states, start):
            state.assign(value)
        return layer(x, mask_bias, training=True)
    return run(x, mask_bias, *[tf.identity(v.value) for v in states])


class BertPretrainer(keras.Model):
    """`BertEncoder` with the masked-LM (tied embeddings) and NSP heads
    (`scatter_free`: the encoder's, and the masked positions picked by
    `gathers.take_positions`)."""

    def __init__(self, config: BertConfig, recompute_activations=False,
                 scatter_free=False, dropout_bits=32, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.scatter_free = scatter_free
        init = _init(config)
        self.encoder = BertEncoder(
            config, recompute_activations=recompute_activations,
            scatter_free=scatter_free, dropout_bits=dropout_bits,
            name="encoder")
        self.mlm_transform = Dense(
            config.hidden_size, activation=_activation(config.hidden_act),
            kernel_initializer=init, name="mlm_transform")
        self.mlm_layer_norm = LayerNorm(name="mlm_layer_norm")
        self.nsp = Dense(2, kernel_initializer=init, name="nsp",
                         dtype="float32")

    def build(self, input_shape=None):
        # Output bias of the MLM head (its weights are the word embeddings).
        self.mlm_bias = self.add_weight(
            shape=(self.config.vocab_size,), initializer="zeros",
            name="mlm_output_bias", dtype="float32")
        super().build(input_shape)

    def call(self, inputs, training=False):
        x, pooled = self.encoder(inputs, training=training)
        nsp_logits = ops.cast(self.nsp(pooled), "float32")
        positions = inputs["masked_lm_positions"]
        gathered = (gathers.take_positions(x, ops.cast(positions, "int32"))
                    if self.scatter_free else ops.take_along_axis(
                        x, ops.expand_dims(positions, -1), axis=1))
        transformed = self.mlm_layer_norm(self.mlm_transform(gathered))
        embeddings = ops.cast(self.encoder.word_embeddings.embeddings,
                              transformed.dtype)
        # Variables read inside a mixed-precision call are autocast: cast
        # the bias back so the logits are float32.
        mlm_logits = (ops.cast(ops.matmul(transformed, ops.transpose(embeddings)),
                               "float32") + ops.cast(self.mlm_bias, "float32"))
        return {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits}


def make_encoder(config: BertConfig, max_seq_length: int = 128) -> BertEncoder:
    """Builds a `BertEncoder` (variables created), e.g. to load an exported
    `encoder.weights.h5` for fine-tuning."""
    encoder = BertEncoder(config, name="encoder")
    encoder(_dummy_inputs(max_seq_length))
    return encoder


def make_pretrainer(config: BertConfig, max_seq_length: int,
                    max_predictions_per_seq: int,
                    recompute_activations: bool = False,
                    scatter_free: bool = False,
                    dropout_bits: int = 32) -> BertPretrainer:
    """Builds the model (variables created) for the given record shape
    (`recompute_activations`, `scatter_free`, `dropout_bits`: see
    `BertEncoder`).

    Call under `strategy.scope()`.
    """
    if max_seq_length > config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the model's "
            f"max_position_embeddings {config.max_position_embeddings}")
    model = BertPretrainer(config, recompute_activations=recompute_activations,
                           scatter_free=scatter_free,
                           dropout_bits=dropout_bits, name="bert_pretrainer")
    dummy = _dummy_inputs(max_seq_length)
    dummy["masked_lm_positions"] = ops.zeros((1, max_predictions_per_seq),
                                             "int32")
    model(dummy)
    return model


def pretraining_loss(labels, outputs, scatter_free=False):
    """Per-example loss: weighted masked-LM cross-entropy + NSP.

    The MLM term of each example is the mean over its real predictions
    (masked_lm_weights); the Trainer averages examples over the global batch.
    `scatter_free`: the cross-entropies as `gathers.sparse_cross_entropy`
    (the same values; under op determinism TensorFlow's own is a gather
    whose gradient is a scatter).
    """
    cross_entropy = (gathers.sparse_cross_entropy if scatter_free else
                     functools.partial(
                         keras.losses.sparse_categorical_crossentropy,
                         from_logits=True))
    weights = ops.cast(labels["masked_lm_weights"], "float32")
    mlm = cross_entropy(labels["masked_lm_ids"], outputs["mlm_logits"])
    mlm = ops.sum(mlm * weights, axis=-1) / ops.maximum(
        ops.sum(weights, axis=-1), 1.0)
    nsp = cross_entropy(ops.reshape(labels["next_sentence_labels"], (-1,)),
                        outputs["nsp_logits"])
    return mlm + nsp


def make_pretraining_loss(scatter_free: bool = False):
    """The loss a `BertPretrainer` made with `scatter_free` trains with."""
    return (functools.partial(pretraining_loss, scatter_free=True)
            if scatter_free else pretraining_loss)


class MaskedLMAccuracy(keras.metrics.Mean):
    """Accuracy over real (weight 1) masked positions (the argmax in one
    fusion with no [B, P, V] output: `elementwise.prediction_stats`)."""

    def __init__(self, name="mlm_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        _, correct = elementwise.prediction_stats(y_pred["mlm_logits"],
                                                  y_true["masked_lm_ids"])
        return super().update_state(correct,
                                    sample_weight=y_true["masked_lm_weights"])


class NextSentenceAccuracy(keras.metrics.Mean):
    def __init__(self, name="nsp_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        predicted = ops.cast(ops.argmax(y_pred["nsp_logits"], axis=-1), "int32")
        label = ops.cast(ops.reshape(y_true["next_sentence_labels"], (-1,)),
                         "int32")
        return super().update_state(ops.cast(ops.equal(predicted, label),
                                             "float32"))


class MaskedLMLoss(keras.metrics.Mean):
    """The masked-LM part of the loss alone (to watch it fall): the same
    cross-entropy as the loss's, as one fusion that writes a value per
    position (`elementwise.prediction_stats`)."""

    def __init__(self, name="mlm_loss", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        weights = ops.cast(y_true["masked_lm_weights"], "float32")
        mlm, _ = elementwise.prediction_stats(y_pred["mlm_logits"],
                                              y_true["masked_lm_ids"])
        return super().update_state(mlm, sample_weight=weights)


class NextSentenceLoss(keras.metrics.Mean):
    """The next-sentence part of the loss alone."""

    def __init__(self, name="nsp_loss", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(keras.losses.sparse_categorical_crossentropy(
            ops.reshape(y_true["next_sentence_labels"], (-1,)),
            y_pred["nsp_logits"], from_logits=True))


def pretraining_metrics():
    return [MaskedLMLoss(), MaskedLMAccuracy(), NextSentenceAccuracy(),
            NextSentenceLoss()]
