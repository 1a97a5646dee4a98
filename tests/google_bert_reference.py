"""Google BERT's pretraining forward pass and losses, in NumPy.

Written from the paper and the math of Google's `modeling.py` and
`run_pretraining.py` (post-LN, LayerNorm epsilon 1e-12, tanh-approximate
gelu, attention mask bias -10000, tied MLM output, NSP weights stored as
[2, hidden]), independent of tfscale's Keras model. Weights are given by
Google's variable names, as in a `bert_model.ckpt`.
"""

import numpy as np
import tensorflow as tf


def random_google_weights(config, seed=0) -> dict:
    """{Google name: array} for every pretraining variable of `config`."""
    rng = np.random.RandomState(seed)
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size

    def w(*shape):
        return (0.05 * rng.randn(*shape)).astype("float32")

    def ln(prefix):  # non-trivial LayerNorm parameters, so mistakes show
        return {f"{prefix}/gamma": (1 + w(h)), f"{prefix}/beta": w(h)}

    values = {"bert/embeddings/word_embeddings": w(v, h),
              "bert/embeddings/token_type_embeddings": w(config.type_vocab_size, h),
              "bert/embeddings/position_embeddings":
                  w(config.max_position_embeddings, h),
              **ln("bert/embeddings/LayerNorm"),
              "bert/pooler/dense/kernel": w(h, h), "bert/pooler/dense/bias": w(h),
              "cls/predictions/transform/dense/kernel": w(h, h),
              "cls/predictions/transform/dense/bias": w(h),
              **ln("cls/predictions/transform/LayerNorm"),
              "cls/predictions/output_bias": w(v),
              "cls/seq_relationship/output_weights": w(2, h),
              "cls/seq_relationship/output_bias": w(2)}
    for n in range(config.num_hidden_layers):
        p = f"bert/encoder/layer_{n}"
        for name, shape in (("attention/self/query", (h, h)),
                            ("attention/self/key", (h, h)),
                            ("attention/self/value", (h, h)),
                            ("attention/output/dense", (h, h)),
                            ("intermediate/dense", (h, i)),
                            ("output/dense", (i, h))):
            values[f"{p}/{name}/kernel"] = w(*shape)
            values[f"{p}/{name}/bias"] = w(shape[1])
        values.update(ln(f"{p}/attention/output/LayerNorm"))
        values.update(ln(f"{p}/output/LayerNorm"))
    return values


def write_tf1_checkpoint(values: dict, prefix: str, global_step: int = 7):
    """A name-based checkpoint as Google's Estimator writes one (with a
    global_step and Adam slots, which importers must ignore)."""
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(a, name=n) for n, a in values.items()]
        first = next(iter(values))
        variables.append(tf.compat.v1.Variable(
            np.zeros_like(values[first]), name=f"{first}/adam_m"))
        variables.append(tf.compat.v1.Variable(
            np.int64(global_step), name="global_step"))
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.variables_initializer(variables))
            return saver.save(session, prefix, write_meta_graph=False)


def _layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * gamma + beta


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) *
                                    (x + 0.044715 * x ** 3)))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def forward(w: dict, config, features: dict) -> dict:
    """Google's pretraining model: logits and losses for one batch."""
    g = {k: np.asarray(v, "float64") for k, v in w.items()}
    ids = features["input_ids"]
    batch, length = ids.shape
    h, heads = config.hidden_size, config.num_attention_heads
    d = h // heads
    x = (g["bert/embeddings/word_embeddings"][ids] +
         g["bert/embeddings/token_type_embeddings"][features["segment_ids"]] +
         g["bert/embeddings/position_embeddings"][:length][None])
    x = _layer_norm(x, g["bert/embeddings/LayerNorm/gamma"],
                    g["bert/embeddings/LayerNorm/beta"])
    bias = (1.0 - features["input_mask"][:, None, None, :]) * -10000.0

    def dense(v, name):
        return v @ g[f"{name}/kernel"] + g[f"{name}/bias"]

    def split(v):
        return v.reshape(batch, length, heads, d).transpose(0, 2, 1, 3)

    for n in range(config.num_hidden_layers):
        p = f"bert/encoder/layer_{n}"
        q = split(dense(x, f"{p}/attention/self/query"))
        k = split(dense(x, f"{p}/attention/self/key"))
        v = split(dense(x, f"{p}/attention/self/value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + bias
        probs = np.exp(_log_softmax(scores))
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, h)
        x = _layer_norm(dense(context, f"{p}/attention/output/dense") + x,
                        g[f"{p}/attention/output/LayerNorm/gamma"],
                        g[f"{p}/attention/output/LayerNorm/beta"])
        inner = _gelu(dense(x, f"{p}/intermediate/dense"))
        x = _layer_norm(dense(inner, f"{p}/output/dense") + x,
                        g[f"{p}/output/LayerNorm/gamma"],
                        g[f"{p}/output/LayerNorm/beta"])
    pooled = np.tanh(dense(x[:, 0], "bert/pooler/dense"))
    positions = features["masked_lm_positions"]
    gathered = x[np.arange(batch)[:, None], positions]
    t = _layer_norm(_gelu(dense(gathered, "cls/predictions/transform/dense")),
                    g["cls/predictions/transform/LayerNorm/gamma"],
                    g["cls/predictions/transform/LayerNorm/beta"])
    mlm_logits = (t @ g["bert/embeddings/word_embeddings"].T +
                  g["cls/predictions/output_bias"])
    nsp_logits = (pooled @ g["cls/seq_relationship/output_weights"].T +
                  g["cls/seq_relationship/output_bias"])
    mlm_log_probs = _log_softmax(mlm_logits)
    labels = features["masked_lm_ids"]
    per_position = -np.take_along_axis(mlm_log_probs, labels[..., None],
                                       -1)[..., 0]
    weights = features["masked_lm_weights"]
    nsp_log_probs = _log_softmax(nsp_logits)
    nsp_labels = features["next_sentence_labels"].reshape(-1)
    return {
        "mlm_logits": mlm_logits, "nsp_logits": nsp_logits,
        "mlm_per_position": per_position,
        "mlm_correct": (mlm_logits.argmax(-1) == labels),
        "nsp_per_example": -nsp_log_probs[np.arange(batch), nsp_labels],
        "nsp_correct": nsp_logits.argmax(-1) == nsp_labels,
        "weights": weights,
    }


def eval_metrics(w: dict, config, batches) -> dict:
    """Google's eval metrics over batches: the masked-LM ones weighted by
    masked_lm_weights over all positions, the next-sentence ones per example."""
    lm_loss = lm_correct = lm_weight = 0.0
    ns_loss = ns_correct = count = 0.0
    for features in batches:
        out = forward(w, config, features)
        lm_loss += (out["mlm_per_position"] * out["weights"]).sum()
        lm_correct += (out["mlm_correct"] * out["weights"]).sum()
        lm_weight += out["weights"].sum()
        ns_loss += out["nsp_per_example"].sum()
        ns_correct += out["nsp_correct"].sum()
        count += len(out["nsp_per_example"])
    return {"masked_lm_loss": lm_loss / lm_weight,
            "masked_lm_accuracy": lm_correct / lm_weight,
            "next_sentence_loss": ns_loss / count,
            "next_sentence_accuracy": ns_correct / count}
