"""The benchmark models of our reference material, small by default.

Each has a config dataclass (sizes are configs, not copies of code) and a
`make_*` factory; `full()` gives the size from the reference.

- Materials MLP (ZIH Horovod study): stress-strain curve [200, 3] ->
  2 material parameters, about 150k parameters.
- Stacked GRU (Baidu SVAIL, "Effectively Scaling Deep Learning Frameworks"):
  5 layers x 3000 units x 100 time steps at full size, about 1 GB of float32
  parameters; small by default.
- ResNet-50 (keras.applications, random weights: nothing is downloaded),
  fed 0-255 pixels (uint8 or float) that its first layer standardizes.
"""

import dataclasses
from typing import Sequence

import keras


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    points: int = 200
    channels: int = 3
    hidden: Sequence[int] = (192, 128, 64)
    outputs: int = 2


def make_materials_mlp(config: MlpConfig = MlpConfig()) -> keras.Model:
    """Curve -> (E, sigma_y); 148,450 parameters with the default config."""
    inputs = keras.Input((config.points, config.channels), name="curve")
    x = keras.layers.Flatten()(inputs)
    for i, units in enumerate(config.hidden):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(config.outputs, dtype="float32",
                                 name="params")(x)
    return keras.Model(inputs, outputs, name="materials_mlp")


@dataclasses.dataclass(frozen=True)
class GruConfig:
    layers: int = 2
    units: int = 128
    timesteps: int = 20
    features: int = 64

    @classmethod
    def full(cls) -> "GruConfig":
        """Baidu's benchmark: 5 x 3000 x 100 steps, about 1 GB of weights."""
        return cls(layers=5, units=3000, timesteps=100, features=3000)


def make_stacked_gru(config: GruConfig = GruConfig()) -> keras.Model:
    """Sequence [T, F] -> one value per step (a regression head)."""
    inputs = keras.Input((config.timesteps, config.features), name="sequence")
    x = inputs
    for i in range(config.layers):
        x = keras.layers.GRU(config.units, return_sequences=True,
                             name=f"gru_{i}")(x)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(x)
    return keras.Model(inputs, outputs, name="stacked_gru")


# ImageNet's RGB mean and standard deviation, on the 0-255 scale.
IMAGENET_MEAN_RGB = (123.675, 116.28, 103.53)
IMAGENET_STDDEV_RGB = (58.395, 57.12, 57.375)


@keras.saving.register_keras_serializable("tfscale")
class Standardize(keras.layers.Layer):
    """0-255 RGB pixels (uint8 or float) -> (x - mean) / stddev, computed in
    the layer's compute dtype: the model's first layer, so images can stay
    uint8 through the input pipeline and the copy to the accelerator."""

    def __init__(self, mean=IMAGENET_MEAN_RGB, stddev=IMAGENET_STDDEV_RGB,
                 **kwargs):
        super().__init__(**kwargs)
        self.mean = tuple(mean)
        self.stddev = tuple(stddev)

    def call(self, images):
        images = keras.ops.cast(images, self.compute_dtype)
        mean = keras.ops.convert_to_tensor(self.mean, self.compute_dtype)
        scale = keras.ops.convert_to_tensor(
            [1.0 / s for s in self.stddev], self.compute_dtype)
        return (images - mean) * scale

    def get_config(self):
        return {**super().get_config(), "mean": self.mean,
                "stddev": self.stddev}


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """ResNet-50's input and head.

    Attributes:
        image_size: Side of the square input.
        classes: Outputs (logits, float32 under mixed precision).
        input_dtype: dtype of the images fed: "uint8" (0-255, the image
            pipeline's default) or a float dtype, also 0-255; the model
            standardizes them with ImageNet's mean and deviation first.
        bn_momentum: Momentum of the batch norms' moving statistics: 0.9,
            as TensorFlow's official ResNet and NVIDIA's (keras.applications
            uses 0.99, whose statistics lag for the first thousand steps:
            evaluation at chance after a short run).
    """

    image_size: int = 64
    classes: int = 10
    input_dtype: str = "float32"
    bn_momentum: float = 0.9

    @classmethod
    def full(cls) -> "ResNetConfig":
        return cls(image_size=224, classes=1000)


def make_resnet50(config: ResNetConfig = ResNetConfig()) -> keras.Model:
    """keras.applications' ResNet-50 (random weights) behind a
    `Standardize` layer, with float32 logits."""
    images = keras.Input((config.image_size, config.image_size, 3),
                         dtype=config.input_dtype, name="image")
    x = Standardize(name="standardize")(images)
    backbone = keras.applications.ResNet50(
        weights=None, input_tensor=x, classes=config.classes,
        classifier_activation=None)
    for layer in backbone.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = config.bn_momentum
    logits = keras.layers.Activation("linear", dtype="float32",
                                     name="logits")(backbone.output)
    return keras.Model(images, logits, name="resnet50")
