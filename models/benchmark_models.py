"""The benchmark models of our reference material, small by default.

Each has a config dataclass (sizes are configs, not copies of code) and a
`make_*` factory; `full()` gives the size from the reference.

- Materials MLP (ZIH Horovod study): stress-strain curve [200, 3] ->
  2 material parameters, about 150k parameters.
- Stacked GRU (Baidu SVAIL, "Effectively Scaling Deep Learning Frameworks"):
  5 layers x 3000 units x 100 time steps at full size, about 1 GB of float32
  parameters; small by default.
- ResNet-50 (keras.applications, random weights: nothing is downloaded).
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


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    image_size: int = 64
    classes: int = 10

    @classmethod
    def full(cls) -> "ResNetConfig":
        return cls(image_size=224, classes=1000)


def make_resnet50(config: ResNetConfig = ResNetConfig()) -> keras.Model:
    """ResNet-50 from keras.applications with random weights."""
    return keras.applications.ResNet50(
        weights=None, input_shape=(config.image_size, config.image_size, 3),
        classes=config.classes, classifier_activation=None)
