"""The transformer's elementwise pieces, each with a hand-written gradient and
compiled on its own by XLA (one fusion forward, one backward).

Without XLA, TensorFlow runs every elementwise op as its own kernel that
writes its whole output to memory, and autodiff adds a kernel per op of
the backward pass: BERT's tanh GELU is 17 passes over its [B, T, 4H]
input, a float32 layer norm 22 over [B, T, H] (`benchmarks/gpu/step_graph.py`).
Here each piece is a `tf.custom_gradient` whose forward and backward are
`tf.function(jit_compile=True)`: XLA fuses each into one kernel (a layer
norm's row statistics are a reduction inside it) that writes only its
outputs. They hold no matmul, so XLA's GEMM choice (docs/gpus.md) does not
enter. Inside a step compiled with `--xla` they are inlined like any
function.

`dropout` draws its uniform numbers with TensorFlow's kernel (XLA's CPU
random numbers are far slower), then one fusion writes the output and the
boolean mask, and the backward one fusion (Keras's writes the random
numbers, their scale and shift, the scaled input and the select, and its
backward two selects and a multiply).

`bias_add` keeps TensorFlow's BiasAdd forward but takes the bias gradient
as a fusion that sums dy's rows in float32 (one rounding), where
TensorFlow's bfloat16 `BiasAddGrad` accumulates in bfloat16 on the CPU
(0.82 relative error over 32,768 rows in `tests/test_elementwise.py`) and
through bfloat16 atomics on a GPU.

Each gradient equals autodiff's of the same formula in float64
(`tests/test_elementwise.py`).
"""

import math

import tensorflow as tf

# GELU, tanh form (Google BERT's `gelu`): 0.5 x (1 + tanh(c (x + k x^3))).
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def _compiled(fn):
    return tf.function(fn, jit_compile=True, autograph=False,
                       reduce_retracing=False)


def _gelu_forward(x):
    t = tf.tanh(_C * (x + _K * (x * x * x)))
    return 0.5 * x * (1.0 + t)


def _gelu_backward(x, dy):
    # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3k x^2): the tanh reused.
    x2 = x * x
    t = tf.tanh(_C * x * (1.0 + _K * x2))
    return dy * (0.5 * (1.0 + t)
                 + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * x2))


_GELU_FORWARD = _compiled(_gelu_forward)
_GELU_BACKWARD = _compiled(_gelu_backward)


@tf.custom_gradient
def gelu_tanh(x):
    """Google BERT's `gelu` (the tanh approximation), one fusion each way:
    the backward recomputes tanh from x (nothing saved but x)."""
    def grad(dy):
        return _GELU_BACKWARD(x, dy)
    return _GELU_FORWARD(x), grad


def _normalized(x, epsilon):
    """(x - mean) / sqrt(var + epsilon) over the last axis, statistics in
    float32 (float64 for float64 x); and 1 / sqrt(var + epsilon)."""
    x = tf.cast(x, _statistics_dtype(x))
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    centred = x - mean
    variance = tf.reduce_mean(centred * centred, axis=-1, keepdims=True)
    inverse = tf.math.rsqrt(variance + epsilon)
    return centred * inverse, inverse


def _statistics_dtype(x):
    return tf.float64 if x.dtype == tf.float64 else tf.float32


def _layer_norm_forward(x, gamma, beta, epsilon):
    normalized, _ = _normalized(x, epsilon)
    return tf.cast(normalized * gamma + beta, x.dtype)


def _layer_norm_backward(x, gamma, epsilon, dy):
    normalized, inverse = _normalized(x, epsilon)
    dy = tf.cast(dy, normalized.dtype)
    axes = list(range(len(x.shape) - 1))
    d_gamma = tf.reduce_sum(dy * normalized, axis=axes)
    d_beta = tf.reduce_sum(dy, axis=axes)
    g = dy * gamma
    dx = inverse * (g - tf.reduce_mean(g, axis=-1, keepdims=True)
                    - normalized * tf.reduce_mean(g * normalized, axis=-1,
                                                  keepdims=True))
    return tf.cast(dx, x.dtype), d_gamma, d_beta


_LAYER_NORM_FORWARD = _compiled(_layer_norm_forward)
_LAYER_NORM_BACKWARD = _compiled(_layer_norm_backward)


def layer_norm(x, gamma, beta, epsilon):
    """Layer normalization over the last axis with float32 statistics (as
    Keras's), gamma and beta float32 (tensors or variables); the output in
    x's dtype."""
    epsilon = tf.constant(epsilon, _statistics_dtype(x))

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        def grad(dy):
            return _LAYER_NORM_BACKWARD(x, gamma, epsilon, dy)
        return _LAYER_NORM_FORWARD(x, gamma, beta, epsilon), grad
    # Variables are read here, outside the custom gradient.
    return normalize(x, tf.identity(gamma), tf.identity(beta))


def _uniform(x, seed):
    """Uniform [0, 1) numbers of x's shape and dtype from a stateless seed,
    by TensorFlow's kernel (XLA's CPU random numbers are ~100x slower:
    533 against 4.8 ms for a dropout of 1M elements on this CPU), without
    the scale and shift `tf.random.stateless_uniform` adds."""
    # As `tf.random.stateless_uniform` does for its default algorithm (the
    # same numbers): the algorithm a constant, which XLA needs to compile
    # the draw well under --xla (given as a tensor, the step of BERT-tiny
    # took 3.5 s instead of 0.1 on this CPU).
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    return tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.shape(x), key=key, counter=counter,
        alg=tf.random.Algorithm.AUTO_SELECT.value, dtype=x.dtype)


def keep_mask_16(shape, rate: float, seed):
    """A dropout keep mask of `shape` from 16 random bits an element: one
    32-bit word (TensorFlow's stateless kernel, `seed` int32 [2]) serves
    two elements, each kept where its half is >= round(rate x 65,536).
    Returns (the boolean mask, the keep probability it realizes,
    1 - round(rate x 65,536) / 65,536: the rate quantized to 1/65,536,
    0.1 -> 0.1000061)."""
    threshold = int(round(rate * 65536))
    size = tf.reduce_prod(shape)
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    words = tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=tf.reshape((size + 1) // 2, [1]), key=key, counter=counter,
        alg=tf.random.Algorithm.AUTO_SELECT.value, dtype=tf.uint32)
    halves = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:size]
    keep = tf.reshape(halves >= tf.constant(threshold, tf.uint16), shape)
    return keep, (65536 - threshold) / 65536


def _dropout_forward(x, uniform, rate):
    keep = uniform >= tf.cast(rate, uniform.dtype)
    return (tf.where(keep, x * tf.cast(1.0 / (1.0 - rate), x.dtype),
                     tf.zeros([], x.dtype)), keep)


def _dropout_backward(dy, keep, rate):
    return tf.where(keep, dy * tf.cast(1.0 / (1.0 - rate), dy.dtype),
                    tf.zeros([], dy.dtype))


_DROPOUT_FORWARD = _compiled(_dropout_forward)
_DROPOUT_BACKWARD = _compiled(_dropout_backward)


def _masked_forward(x, keep, scale):
    return tf.where(keep, x * tf.cast(scale, x.dtype), tf.zeros([], x.dtype))


_MASKED_FORWARD = _compiled(_masked_forward)


def dropout(x, rate, seed, bits: int = 32):
    """Inverted dropout: elements kept with probability 1 - rate, scaled
    by 1 / (1 - rate). `seed`: int32 [2] (a stateless seed, e.g. a Keras
    `SeedGenerator`'s next state). The uniform draw is TensorFlow's kernel;
    the rest is one fusion each way, the forward also writing the boolean
    mask the backward reads.

    `bits=16`: the mask from 16 random bits an element (`keep_mask_16`:
    half the random words, no uniform numbers written), the rate quantized
    to 1/65,536 and the kept elements scaled by 1 / the keep probability
    that realizes (other masks than `bits=32`'s, the same expectation)."""
    if bits == 16:
        keep, kept = keep_mask_16(tf.shape(x), rate, seed)
        scale = tf.constant(1.0 / kept, tf.float32)

        @tf.custom_gradient
        def drop16(x):
            def grad(dy):
                return _MASKED_FORWARD(dy, keep, scale)
            return _MASKED_FORWARD(x, keep, scale), grad
        return drop16(x)
    rate = tf.constant(rate, tf.float32)
    uniform = _uniform(x, seed)

    @tf.custom_gradient
    def drop(x):
        y, keep = _DROPOUT_FORWARD(x, uniform, rate)

        def grad(dy):
            return _DROPOUT_BACKWARD(dy, keep, rate)
        return y, grad
    return drop(x)


def _prediction_stats(logits, labels):
    # Row reductions of the logits: nothing of their size is written.
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(labels, tf.int32)
    picked = tf.gather(logits, labels, batch_dims=len(labels.shape))
    cross_entropy = tf.reduce_logsumexp(logits, axis=-1) - picked
    predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return cross_entropy, tf.cast(tf.equal(predicted, labels), tf.float32)


_PREDICTION_STATS = _compiled(_prediction_stats)


def prediction_stats(logits, labels):
    """(cross-entropy, 1.0 where the argmax is the label) per position of
    `logits` [..., V] against integer `labels` [...]: one fusion that reads
    the logits once and writes two values per position (a metric's; no
    gradient). TensorFlow's own ops would write the softmax gradient
    (`SparseSoftmaxCrossEntropyWithLogits` computes it even for a metric)
    and run a separate ArgMax."""
    return _PREDICTION_STATS(logits, labels)


def _bias_gradient(dy):
    """The sum of dy's rows, accumulated in float32 at least (in the
    fusion: no float32 copy of dy is written)."""
    rows = tf.reshape(dy, [-1, dy.shape[-1]])
    return tf.reduce_sum(tf.cast(rows, _statistics_dtype(rows)), axis=0)


_BIAS_GRADIENT = _compiled(_bias_gradient)


def bias_add(x, bias):
    """`tf.nn.bias_add(x, bias)` (bias in x's dtype, a tensor or variable)
    whose bias gradient is one fusion: the rows of dy summed in float32,
    rounded once to the bias's dtype."""
    return _bias_add(x, tf.identity(bias))


@tf.custom_gradient
def _bias_add(x, bias):
    def grad(dy):
        return dy, tf.cast(_BIAS_GRADIENT(dy), bias.dtype)
    return tf.nn.bias_add(x, bias), grad
