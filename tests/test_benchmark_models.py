import keras
import numpy as np

from models import benchmark_models as bm


def gru_parameters(layers, units, features):
    """Keras GRU (reset_after): 3 gates x (input + recurrent + 2 biases)."""
    total, inputs = 0, features
    for _ in range(layers):
        total += 3 * (inputs * units + units * units + 2 * units)
        inputs = units
    return total + units + 1  # head


def test_materials_mlp_has_about_150k_parameters():
    model = bm.make_materials_mlp()
    assert 140_000 <= model.count_params() <= 160_000
    out = model(np.zeros((4, 200, 3), "float32"))
    assert out.shape == (4, 2)


def test_gru_small_runs_and_full_size_is_about_a_gigabyte():
    model = bm.make_stacked_gru()
    assert model(np.zeros((2, 20, 64), "float32")).shape == (2, 20, 1)
    assert model.count_params() == gru_parameters(2, 128, 64)
    full = bm.GruConfig.full()
    size = gru_parameters(full.layers, full.units, full.features) * 4
    assert 1.0e9 <= size <= 1.2e9  # bytes of float32 weights


def test_resnet50_small_input():
    model = bm.make_resnet50()
    assert model(np.zeros((1, 64, 64, 3), "float32")).shape == (1, 10)
    assert 23_000_000 < model.count_params() < 24_000_000


def test_resnet50_takes_uint8_pixels_and_standardizes_them():
    layer = bm.Standardize()
    pixels = np.array([[[[0, 128, 255]]]], "uint8")
    expected = (pixels.astype("float32") - np.array(bm.IMAGENET_MEAN_RGB)) / (
        np.array(bm.IMAGENET_STDDEV_RGB))
    np.testing.assert_allclose(np.asarray(layer(pixels)), expected, rtol=1e-6)
    model = bm.make_resnet50(bm.ResNetConfig(image_size=32, classes=3,
                                             input_dtype="uint8"))
    assert model.inputs[0].dtype == "uint8"
    assert model.get_layer("standardize") is model.layers[1]
    logits = model(np.full((2, 32, 32, 3), 7, "uint8"))
    assert logits.shape == (2, 3) and logits.dtype == "float32"
    assert {layer.momentum for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)} == {0.9}
