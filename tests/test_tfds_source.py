"""tensorflow-datasets: the stress-strain builder and the sharded tfds source."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from input_pipelines import materials, tfds_source


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tfds"))
    tfds.builder("stress_strain/small", data_dir=directory).download_and_prepare()
    return directory


def test_synthetic_curves_encode_their_parameters():
    curves, params = materials.synthesize(np.random.RandomState(0), 256)
    assert curves.shape == (256, 200, 3) and params.shape == (256, 2)
    # Young's modulus is the initial slope of stress over strain.
    slope = curves[:, 1:4, 1].mean(axis=1) / curves[:, 1:4, 0].mean(axis=1)
    assert np.corrcoef(slope, params[:, 0])[0, 1] > 0.99
    # Plastic strain starts where stress reaches the yield stress.
    yielded = curves[:, :, 2] > 1e-3
    first = yielded.argmax(axis=1)
    stress_at_yield = curves[np.arange(256), first, 1]
    assert np.corrcoef(stress_at_yield, params[:, 1])[0, 1] > 0.99


def test_prepared_splits_have_the_configured_sizes(data_dir):
    builder = tfds.builder("stress_strain/small", data_dir=data_dir)
    assert builder.info.splits["train"].num_examples == 2048
    assert builder.info.splits["test"].num_examples == 512
    curve, params = next(iter(builder.as_dataset(split="test",
                                                 as_supervised=True)))
    assert curve.shape == (200, 3) and params.shape == (2,)


def context(num, index):
    return tf.distribute.InputContext(num_input_pipelines=num,
                                      input_pipeline_id=index,
                                      num_replicas_in_sync=num)


def test_two_workers_read_disjoint_halves_of_the_test_split(data_dir):
    config = tfds_source.TfdsConfig("stress_strain/small", split="test",
                                    data_dir=data_dir, training=False)
    dataset_fn = tfds_source.make_dataset_fn(config, per_replica_batch_size=64)
    seen = []
    for index in range(2):
        rows = [params.numpy() for _, params in dataset_fn(context(2, index))]
        seen.append({tuple(r) for batch in rows for r in batch})
    assert not seen[0] & seen[1]
    assert len(seen[0]) + len(seen[1]) == 512


def test_training_batches_repeat(data_dir):
    config = tfds_source.TfdsConfig("stress_strain/small", data_dir=data_dir,
                                    seed=3)
    batches = list(tfds_source.make_dataset_fn(config, 512)(None).take(5))
    assert all(curve.shape == (512, 200, 3) for curve, _ in batches)


def test_unprepared_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not prepared"):
        tfds_source.make_dataset_fn(
            tfds_source.TfdsConfig("stress_strain/small",
                                   data_dir=str(tmp_path)), 8)


def test_works_with_tfds_mock_data():
    with tfds.testing.mock_data(num_examples=48,
                                policy=tfds.testing.MockPolicy.USE_CODE):
        config = tfds_source.TfdsConfig("stress_strain/medium", split="train",
                                        training=False)
        batches = list(tfds_source.make_dataset_fn(config, 16)(None))
    assert [c.shape[0] for c, _ in batches] == [16, 16, 16]
