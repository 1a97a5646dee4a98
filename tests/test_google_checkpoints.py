"""Google's TF1 BERT checkpoints: the model computes what Google's computes.

A name-based checkpoint with Google's variable names (written with
`tf.compat.v1.train.Saver`, global_step and an Adam slot included) is loaded
into tfscale's BERT; its logits and losses must match a NumPy implementation
of Google's forward pass on the same weights. Export back to Google's format
round-trips.
"""

import numpy as np
import pytest
import tensorflow as tf

from models import bert, bert_checkpoints, bert_config
from tests import google_bert_reference as reference

SEQ, PRED = 24, 5


def config(**overrides):
    values = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64)
    values.update(overrides)
    return bert_config.BertConfig(**values)


def features(n=6, seed=1, vocab=96):
    rng = np.random.RandomState(seed)
    mask = np.ones((n, SEQ), "int32")
    mask[:, 18:] = 0  # padding, to exercise the -10000 mask bias
    weights = np.ones((n, PRED), "float32")
    weights[:, 4:] = 0.0  # a padded prediction slot
    return {
        "input_ids": rng.randint(1, vocab, (n, SEQ)).astype("int32"),
        "input_mask": mask,
        "segment_ids": (np.arange(SEQ)[None] >= 9).astype("int32").repeat(n, 0),
        "masked_lm_positions": rng.randint(1, 18, (n, PRED)).astype("int32"),
        "masked_lm_ids": rng.randint(1, vocab, (n, PRED)).astype("int32"),
        "masked_lm_weights": weights,
        "next_sentence_labels": rng.randint(0, 2, (n, 1)).astype("int32"),
    }


@pytest.fixture(scope="module")
def google_checkpoint(tmp_path_factory):
    values = reference.random_google_weights(config())
    prefix = str(tmp_path_factory.mktemp("google") / "bert_model.ckpt")
    return values, reference.write_tf1_checkpoint(values, prefix)


def loaded_model(path, cfg=None):
    model = bert.make_pretrainer(cfg or config(), SEQ, PRED)
    bert_checkpoints.load_google_checkpoint(model, path)
    return model


def test_forward_matches_numpy_reference_of_googles_model(google_checkpoint):
    values, path = google_checkpoint
    model = loaded_model(path)
    batch = features()
    inputs = {k: batch[k] for k in bert_records_inputs()}
    ours = model(inputs, training=False)
    theirs = reference.forward(values, config(), batch)
    np.testing.assert_allclose(ours["mlm_logits"].numpy(), theirs["mlm_logits"],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours["nsp_logits"].numpy(), theirs["nsp_logits"],
                               rtol=1e-4, atol=1e-5)
    # Google's masked-LM metric: weighted mean over all real predictions.
    metric = bert.MaskedLMLoss()
    metric.update_state(batch, ours)
    expected = reference.eval_metrics(values, config(), [batch])
    assert float(metric.result()) == pytest.approx(
        expected["masked_lm_loss"], rel=1e-4)


def bert_records_inputs():
    return ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")


def test_export_to_google_format_round_trips(google_checkpoint, tmp_path):
    _, path = google_checkpoint
    model = loaded_model(path)
    exported = bert_checkpoints.save_google_checkpoint(
        model, str(tmp_path / "bert_model.ckpt"))
    reader = tf.train.load_checkpoint(exported)
    assert reader.get_variable_to_shape_map()[
        "cls/seq_relationship/output_weights"] == [2, 32]  # Google's layout
    again = loaded_model(exported)
    for a, b in zip(model.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_other_vocab_is_one_error_naming_variable_and_shapes(google_checkpoint):
    _, path = google_checkpoint
    model = bert.make_pretrainer(config(vocab_size=128), SEQ, PRED)
    before = [v.numpy().copy() for v in model.weights]
    with pytest.raises(bert_checkpoints.GoogleCheckpointError,
                       match=r"bert/embeddings/word_embeddings has shape "
                             r"\[96, 32\] in the checkpoint but \[128, 32\]"):
        bert_checkpoints.load_google_checkpoint(model, path)
    for a, b in zip(before, model.weights):  # nothing half-loaded
        np.testing.assert_array_equal(a, b.numpy())


def test_missing_layer_is_named(google_checkpoint):
    _, path = google_checkpoint
    model = bert.make_pretrainer(config(num_hidden_layers=3), SEQ, PRED)
    with pytest.raises(bert_checkpoints.GoogleCheckpointError,
                       match=r"has no bert/encoder/layer_2/"):
        bert_checkpoints.load_google_checkpoint(model, path)
