"""Materials-science regression data as a tensorflow-datasets builder.

From our reference scaling study (ZIH, Horovod): a stress-strain curve of
200 points x 3 values -> 2 material parameters. The curves are synthesized
(no download): an elastic-plastic material with Young's modulus E and yield
stress sigma_y, linear hardening, loaded to 5% strain, with 0.5% stress noise.

    curve  [200, 3] float32: strain, stress (GPa), plastic strain
    params [2] float32: E / 100 GPa, sigma_y / 1 GPa  (both of order 1)

Configs: `small` (2,048 train / 512 test, for tests), `medium` (65,536 /
8,192), `full` (1,000,000 / 100,000, as in the study). Prepare with
`tfds.builder("stress_strain/small", data_dir=...).download_and_prepare()`.
"""

import numpy as np

from input_pipelines.extras import require

tfds = require("tensorflow_datasets", "tfds")

POINTS = 200
MAX_STRAIN = 0.05
HARDENING = 0.02  # plastic tangent modulus as a fraction of E


def synthesize(rng: np.random.RandomState, count: int):
    """`count` curves and their parameters (vectorized)."""
    youngs = rng.uniform(50.0, 250.0, count)          # GPa
    yield_stress = rng.uniform(0.1, 0.8, count)       # GPa
    strain = np.linspace(0.0, MAX_STRAIN, POINTS)[None, :]
    elastic = youngs[:, None] * strain
    yield_strain = (yield_stress / youngs)[:, None]
    plastic = (yield_stress[:, None] + HARDENING * youngs[:, None] *
               (strain - yield_strain))
    stress = np.where(strain <= yield_strain, elastic, plastic)
    stress = stress * (1.0 + 0.005 * rng.standard_normal(stress.shape))
    plastic_strain = np.maximum(strain - stress / youngs[:, None], 0.0)
    curves = np.stack([np.broadcast_to(strain, stress.shape), stress,
                       plastic_strain], axis=-1).astype(np.float32)
    params = np.stack([youngs / 100.0, yield_stress], axis=-1).astype(np.float32)
    return curves, params


class StressStrainConfig(tfds.core.BuilderConfig):
    def __init__(self, *, num_train: int, num_test: int, **kwargs):
        super().__init__(version="1.0.0", **kwargs)
        self.num_train = num_train
        self.num_test = num_test


class StressStrain(tfds.core.GeneratorBasedBuilder):
    """Synthetic stress-strain curves -> (Young's modulus, yield stress)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [
        StressStrainConfig(name="small", num_train=2048, num_test=512,
                           description="For tests."),
        StressStrainConfig(name="medium", num_train=65536, num_test=8192,
                           description="For benchmarks on one host."),
        StressStrainConfig(name="full", num_train=1_000_000, num_test=100_000,
                           description="The reference study's size."),
    ]

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "curve": tfds.features.Tensor(shape=(POINTS, 3),
                                              dtype=np.float32),
                "params": tfds.features.Tensor(shape=(2,), dtype=np.float32),
            }),
            supervised_keys=("curve", "params"),
            description=__doc__)

    def _split_generators(self, dl_manager):
        del dl_manager  # synthesized, nothing to download
        return {"train": self._generate_examples(self.builder_config.num_train, 0),
                "test": self._generate_examples(self.builder_config.num_test, 1)}

    def _generate_examples(self, count, seed):
        rng = np.random.RandomState(seed)
        for start in range(0, count, 4096):
            curves, params = synthesize(rng, min(4096, count - start))
            for offset, (curve, param) in enumerate(zip(curves, params)):
                yield start + offset, {"curve": curve, "params": param}
