"""Patterned JPEG images in class folders: real JPEGs at ImageNet's sizes,
made on this machine (nothing is downloaded), that a model can learn.

Class c of K has its own hue and stripe angle; every image gets a random
size (300-500 px by default), stripe phase and frequency, and pixel noise,
and is encoded with `tf.io.encode_jpeg` at quality 90 (ImageNet's JPEGs
are about that). Used by the tests, the image benchmark and the demo.
"""

import colorsys
import math
import os
from typing import List, Tuple

import numpy as np
import tensorflow as tf


def pattern_image(label: int, num_classes: int, height: int, width: int,
                  rng: np.random.Generator) -> np.ndarray:
    """One uint8 [height, width, 3] image of class `label`."""
    hue = label / num_classes
    color = np.array(colorsys.hsv_to_rgb(hue, 0.8, 0.9), np.float32) * 255
    angle = math.pi * ((label * 0.618034) % 1.0)
    period = rng.uniform(12, 40)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * math.pi)
    stripes = np.sin((x * math.cos(angle) + y * math.sin(angle))
                     * (2 * math.pi / period) + phase)
    image = color * (0.65 + 0.35 * stripes)[..., None]
    image += rng.normal(0, 12, image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_image_folder(image_dir: str, num_classes: int,
                       images_per_class: int, *, size_range: Tuple[int, int]
                       = (300, 500), quality: int = 90, seed: int = 0
                       ) -> List[str]:
    """Writes image_dir/class_XXX/img_YYYY.jpg; returns the class names."""
    rng = np.random.default_rng(seed)
    names = [f"class_{c:03d}" for c in range(num_classes)]
    for label, name in enumerate(names):
        folder = os.path.join(image_dir, name)
        tf.io.gfile.makedirs(folder)
        for i in range(images_per_class):
            height, width = (int(v) for v in rng.integers(
                size_range[0], size_range[1] + 1, size=2))
            image = pattern_image(label, num_classes, height, width, rng)
            jpeg = tf.io.encode_jpeg(image, quality=quality).numpy()
            with open(os.path.join(folder, f"img_{i:04d}.jpg"), "wb") as f:
                f.write(jpeg)
    return names
