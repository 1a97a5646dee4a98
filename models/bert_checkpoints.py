"""Google's TF1 BERT checkpoints (`bert_model.ckpt`): import and export.

Google's `modeling.py` names every variable (`bert/embeddings/...`,
`bert/encoder/layer_N/...`, `cls/predictions/...`, `cls/seq_relationship/...`).
`google_names(model)` maps each of those names to the variable of a
`BertPretrainer` that holds the same tensor; `load_google_checkpoint` reads a
name-based checkpoint into the model (checking every name and shape first,
so a mismatch is one error and nothing is half-loaded) and
`save_google_checkpoint` writes one that Google's tools read. Adam slots and
`global_step` in Google's files are ignored.

Kernels are [in, out] in both (a TF1 `tf.layers.dense` kernel and a Keras
`Dense` kernel). The one exception: Google stores the next-sentence weights
as `cls/seq_relationship/output_weights` [2, hidden], the transpose of the
Keras kernel.
"""

from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

from models import bert

TRANSPOSED = ("cls/seq_relationship/output_weights",)


class GoogleCheckpointError(ValueError):
    """A Google checkpoint does not fit the model; the message names why."""


def _dense(prefix: str, layer) -> Dict[str, object]:
    return {f"{prefix}/kernel": layer.kernel, f"{prefix}/bias": layer.bias}


def _layer_norm(prefix: str, layer) -> Dict[str, object]:
    return {f"{prefix}/gamma": layer.gamma, f"{prefix}/beta": layer.beta}


def google_names(model: bert.BertPretrainer) -> Dict[str, object]:
    """Google's variable name -> this model's variable."""
    encoder = model.encoder
    names = {
        "bert/embeddings/word_embeddings": encoder.word_embeddings.embeddings,
        "bert/embeddings/token_type_embeddings":
            encoder.type_embeddings.embeddings,
        "bert/embeddings/position_embeddings":
            encoder.position_embeddings.embeddings,
        **_layer_norm("bert/embeddings/LayerNorm", encoder.embedding_layer_norm),
        **_dense("bert/pooler/dense", encoder.pooler),
        **_dense("cls/predictions/transform/dense", model.mlm_transform),
        **_layer_norm("cls/predictions/transform/LayerNorm",
                      model.mlm_layer_norm),
        "cls/predictions/output_bias": model.mlm_bias,
        "cls/seq_relationship/output_weights": model.nsp.kernel,
        "cls/seq_relationship/output_bias": model.nsp.bias,
    }
    for i, layer in enumerate(encoder.transformer_layers):
        p = f"bert/encoder/layer_{i}"
        attention = layer.attention
        names.update({
            **_dense(f"{p}/attention/self/query", attention.query),
            **_dense(f"{p}/attention/self/key", attention.key),
            **_dense(f"{p}/attention/self/value", attention.value),
            **_dense(f"{p}/attention/output/dense", attention.output_dense),
            **_layer_norm(f"{p}/attention/output/LayerNorm",
                          layer.attention_layer_norm),
            **_dense(f"{p}/intermediate/dense", layer.intermediate),
            **_dense(f"{p}/output/dense", layer.output_dense),
            **_layer_norm(f"{p}/output/LayerNorm", layer.output_layer_norm),
        })
    return names


def _google_shape(name: str, variable) -> Tuple[int, ...]:
    shape = tuple(variable.shape)
    return shape[::-1] if name in TRANSPOSED else shape


def is_name_based(path: str) -> bool:
    """True for a TF1 name-based checkpoint (no TF2 object graph)."""
    return not tf.train.load_checkpoint(path).has_tensor(
        "_CHECKPOINTABLE_OBJECT_GRAPH")


def load_google_checkpoint(model: bert.BertPretrainer, path: str) -> str:
    """Assigns every weight of `model` from Google's checkpoint at `path`.

    Raises:
        GoogleCheckpointError: A name is missing or a shape differs (checked
            for all variables before any is assigned).
    """
    try:
        reader = tf.train.load_checkpoint(path)
    except (tf.errors.OpError, ValueError):
        raise GoogleCheckpointError(f"no checkpoint at {path}") from None
    shapes = reader.get_variable_to_shape_map()
    names = google_names(model)
    for name, variable in names.items():
        expected = _google_shape(name, variable)
        if name not in shapes:
            raise GoogleCheckpointError(
                f"{path} has no {name} (shape {list(expected)}): not a "
                f"checkpoint of this BERT configuration")
        if tuple(shapes[name]) != expected:
            raise GoogleCheckpointError(
                f"{path}: {name} has shape {list(shapes[name])} in the "
                f"checkpoint but {list(expected)} in the model")
    for name, variable in names.items():
        value = reader.get_tensor(name)
        variable.assign(value.T if name in TRANSPOSED else value)
    return path


def save_google_checkpoint(model: bert.BertPretrainer, prefix: str) -> str:
    """Writes the model as a TF1 name-based checkpoint with Google's names.

    Returns:
        The checkpoint prefix (pass it as `--init_checkpoint` to Google's
        `run_classifier.py` or `run_pretraining.py`).
    """
    values = {}
    for name, variable in google_names(model).items():
        value = np.asarray(variable.numpy())
        values[name] = value.T if name in TRANSPOSED else value
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(value, name=name)
                     for name, value in values.items()]
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.variables_initializer(variables))
            return saver.save(session, prefix, write_meta_graph=False)
