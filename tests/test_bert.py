"""BERT model, config, records and the record writer."""

import json
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from input_pipelines import bert_instances as bi
from input_pipelines import bert_records
from input_pipelines.bert_records import BertRecordSpec
from models import bert, bert_config
from tfscale import precision

SPEC = BertRecordSpec(32, 5)


def tiny(**overrides):
    return bert_config.preset("bert_tiny", vocab_size=128, **overrides)


def batch(n=4, seed=0):
    rng = np.random.RandomState(seed)
    inputs = {
        "input_ids": rng.randint(5, 128, (n, 32)).astype("int32"),
        "input_mask": np.ones((n, 32), "int32"),
        "segment_ids": np.zeros((n, 32), "int32"),
        "masked_lm_positions": np.tile(np.arange(1, 6), (n, 1)).astype("int32"),
    }
    labels = {
        "masked_lm_ids": rng.randint(5, 128, (n, 5)).astype("int32"),
        "masked_lm_weights": np.ones((n, 5), "float32"),
        "next_sentence_labels": rng.randint(0, 2, (n, 1)).astype("int32"),
    }
    return inputs, labels


def test_presets_follow_google_sizes_and_multiples_of_eight():
    for name, expected in [("bert_tiny", (2, 128)), ("bert_base", (12, 768)),
                           ("bert_large", (24, 1024))]:
        config = bert_config.preset(name)
        assert (config.num_hidden_layers, config.hidden_size) == expected
        assert config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0
    with pytest.raises(ValueError, match="unknown model 'bert_huge'"):
        bert_config.preset("bert_huge")


def test_google_config_file_round_trip(tmp_path):
    path = tmp_path / "bert_config.json"
    google = tiny().to_dict()
    google["some_future_key"] = 1  # ignored, as Google's reader would
    path.write_text(json.dumps(google))
    assert bert_config.BertConfig.from_json_file(str(path)) == tiny()
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match=r"bert_config.json: BERT config lacks"):
        bert_config.BertConfig.from_json_file(str(path))


def test_model_outputs_and_loss():
    model = bert.make_pretrainer(tiny(), 32, 5)
    inputs, labels = batch()
    outputs = model(inputs)
    assert outputs["mlm_logits"].shape == (4, 5, 128)
    assert outputs["nsp_logits"].shape == (4, 2)
    loss = bert.pretraining_loss(labels, outputs)
    assert loss.shape == (4,)
    # Untrained: about ln(128) for MLM plus ln(2) for NSP.
    assert float(np.mean(loss)) == pytest.approx(np.log(128) + np.log(2), rel=0.1)


def test_mlm_head_is_tied_to_the_word_embeddings():
    model = bert.make_pretrainer(tiny(), 32, 5)
    paths = [v.path for v in model.trainable_variables]
    assert not any("mlm" in p and "kernel" in p and "transform" not in p
                   for p in paths)
    inputs, labels = batch()
    with tf.GradientTape() as tape:
        loss = bert.pretraining_loss(labels, model(inputs))
    embeddings = model.encoder.word_embeddings.embeddings
    grad = tape.gradient(loss, embeddings)
    # Rows of the masked-LM labels get gradient through the output layer
    # even when those tokens never appear in the input.
    unused = sorted(set(range(5, 128)) - set(inputs["input_ids"].ravel()))
    labels_only = [t for t in labels["masked_lm_ids"].ravel() if t in unused]
    assert labels_only and np.abs(tf.convert_to_tensor(grad).numpy()[labels_only]).sum() > 0


def test_padding_does_not_change_the_outputs():
    model = bert.make_pretrainer(tiny(hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0), 32, 5)
    inputs, _ = batch(1)
    inputs["input_mask"][:, 20:] = 0
    first = model(inputs)["mlm_logits"].numpy()
    inputs["input_ids"][:, 20:] = 7  # change only padded tokens
    np.testing.assert_allclose(model(inputs)["mlm_logits"].numpy(), first,
                               rtol=1e-5, atol=1e-5)


def test_mixed_float16_keeps_logits_and_loss_in_float32():
    precision.set_precision("mixed_float16")
    try:
        model = bert.make_pretrainer(tiny(), 32, 5)
        inputs, labels = batch()
        outputs = model(inputs)
        assert model.encoder.layer_0.attention.query.compute_dtype == "float16"
        assert outputs["mlm_logits"].dtype == "float32"
        assert np.isfinite(bert.pretraining_loss(labels, outputs).numpy()).all()
    finally:
        precision.set_precision("float32")


def test_metrics_count_only_real_predictions():
    metric = bert.MaskedLMAccuracy()
    logits = np.zeros((1, 3, 4), "float32")
    logits[0, 0, 2] = logits[0, 1, 1] = logits[0, 2, 3] = 5.0
    y = {"masked_lm_ids": np.array([[2, 0, 0]]),
         "masked_lm_weights": np.array([[1.0, 1.0, 0.0]], "float32")}
    metric.update_state(y, {"mlm_logits": logits})
    assert float(metric.result()) == pytest.approx(0.5)


def documents(n_docs=6, n_sentences=8, seed=0):
    rng = random.Random(seed)
    return [[[rng.randint(5, 99) for _ in range(rng.randint(3, 12))]
             for _ in range(n_sentences)] for _ in range(n_docs)]


def test_instances_follow_google_rules():
    ids = bi.SpecialIds(cls=2, sep=3, mask=4, vocab_size=100)
    config = bi.InstanceConfig(max_seq_length=32, max_predictions_per_seq=5,
                               dupe_factor=3)
    instances = bi.create_instances(documents(), config, ids, random.Random(1))
    assert len(instances) > 20
    assert {i.is_random_next for i in instances} == {True, False}
    for inst in instances:
        assert len(inst.tokens) <= 32 and inst.tokens[0] == 2
        assert inst.tokens.count(3) == 2 and inst.tokens[-1] == 3
        first_sep = inst.tokens.index(3)
        assert inst.segment_ids == ([0] * (first_sep + 1) +
                                    [1] * (len(inst.tokens) - first_sep - 1))
        assert 1 <= len(inst.masked_lm_positions) <= 5
        assert inst.masked_lm_positions == sorted(inst.masked_lm_positions)
        # [CLS] and [SEP] are never masked (SEPs survive masking unchanged).
        seps = [i for i, t in enumerate(inst.tokens) if t == 3]
        assert all(p != 0 and p not in seps for p in inst.masked_lm_positions)
        assert all(t not in (2, 3) for t in inst.masked_lm_ids)
    masked = sum(inst.tokens[p] == 4 for inst in instances
                 for p in inst.masked_lm_positions)
    total = sum(len(inst.masked_lm_positions) for inst in instances)
    assert 0.65 < masked / total < 0.95  # about 80% become [MASK]


def google_style_record(seq=32, pred=5):
    """A record built field by field as Google's writer does (not our code)."""
    def ints(v):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=v))
    feature = {
        "input_ids": ints([2, 10, 11, 3, 12, 3] + [0] * (seq - 6)),
        "input_mask": ints([1] * 6 + [0] * (seq - 6)),
        "segment_ids": ints([0, 0, 0, 0, 1, 1] + [0] * (seq - 6)),
        "masked_lm_positions": ints([1, 4] + [0] * (pred - 2)),
        "masked_lm_ids": ints([10, 12] + [0] * (pred - 2)),
        "masked_lm_weights": tf.train.Feature(float_list=tf.train.FloatList(
            value=[1.0, 1.0] + [0.0] * (pred - 2))),
        "next_sentence_labels": ints([1]),
    }
    return tf.train.Example(features=tf.train.Features(
        feature=feature)).SerializeToString()


def test_google_records_and_ours_parse_alike():
    ours = bert_records.serialize_instance([2, 10, 11, 3, 12, 3],
                                           [0, 0, 0, 0, 1, 1], [1, 4], [10, 12],
                                           True, SPEC)
    parse = bert_records.make_parse_fn(SPEC)
    a_inputs, a_labels = parse(tf.constant([ours]))
    b_inputs, b_labels = parse(tf.constant([google_style_record()]))
    for key in a_inputs:
        np.testing.assert_array_equal(a_inputs[key], b_inputs[key])
        assert a_inputs[key].dtype == tf.int32
    for key in a_labels:
        np.testing.assert_array_equal(a_labels[key], b_labels[key])
    # The same message; ours serializes its feature map sorted (protobuf's
    # deterministic mode), so records made in any process are the same bytes.
    assert tf.train.Example.FromString(ours) == tf.train.Example.FromString(
        google_style_record())
    assert ours == tf.train.Example.FromString(ours).SerializeToString(
        deterministic=True)


def test_gelu_is_googles_tanh_approximation():
    """Google's `hidden_act: "gelu"` (modeling.gelu), not Keras's erf form."""
    model = bert.make_pretrainer(tiny(), 32, 5)
    activation = model.encoder.layer_0.intermediate.activation
    x = np.linspace(-4, 4, 81).astype("float32")
    google = 0.5 * x * (1.0 + np.tanh(np.sqrt(2 / np.pi) *
                                      (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(np.asarray(activation(x)), google, rtol=1e-5,
                               atol=1e-6)
    erf = np.asarray(keras.activations.gelu(x))
    assert np.abs(erf - google).max() > 1e-4  # the two forms do differ here


def test_recomputed_activations_give_the_same_gradients_and_masks():
    # Dropout on: the recomputed forward must draw the same masks (the seed
    # generators set back) and leave the seed states where one plain call
    # leaves them; two steps, so the second starts from moved states.
    config = bert_config.BertConfig(vocab_size=100, hidden_size=32,
                                    num_hidden_layers=2,
                                    num_attention_heads=2,
                                    intermediate_size=64)
    rng = np.random.RandomState(0)
    inputs = {"input_ids": rng.randint(0, 100, (4, 16)).astype("int32"),
              "input_mask": np.ones((4, 16), "int32"),
              "segment_ids": np.zeros((4, 16), "int32"),
              "masked_lm_positions": rng.randint(0, 16, (4, 4)).astype(
                  "int32")}
    labels = {"masked_lm_ids": rng.randint(0, 100, (4, 4)).astype("int32"),
              "masked_lm_weights": np.ones((4, 4), "float32"),
              "next_sentence_labels": np.zeros((4, 1), "int32")}
    results = []
    for recompute in (False, True):
        keras.utils.set_random_seed(3)
        model = bert.make_pretrainer(config, 16, 4,
                                     recompute_activations=recompute)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(bert.pretraining_loss(
                    labels, model(inputs, training=True)))
            return [tf.convert_to_tensor(g) for g in
                    tape.gradient(loss, model.trainable_variables)]
        grads = [[g.numpy() for g in step()] for _ in range(2)]
        states = [v.numpy() for v in model.variables
                  if "seed_generator_state" in v.path]
        results.append((grads, states))
    (plain, plain_states), (again, again_states) = results
    for a, b in zip(sum(plain, []), sum(again, [])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain_states, again_states):
        np.testing.assert_array_equal(a, b)


def test_the_encoder_names_the_features_it_takes():
    """Model Garden's feature names are refused in a line that names
    Google's, which the encoder takes (docs/checkpoints.md)."""
    encoder = bert.make_encoder(tiny(), 32)
    ids = np.ones((2, 32), "int32")
    with pytest.raises(ValueError, match=r"lack \['input_ids', 'segment_ids'"
                       r"\].*Model Garden's input_word_ids"):
        encoder({"input_word_ids": ids, "input_mask": ids,
                 "input_type_ids": ids * 0})
