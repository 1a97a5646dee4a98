"""tfscale: distributed training for TensorFlow 2 / Keras 3 models."""

from tfscale.cluster import ClusterConfig, ClusterInfo, resolve_cluster
from tfscale.strategies import make_strategy
from tfscale.keras_fit import enable_multi_worker_fit
from tfscale.trainer import TrainConfig, Trainer

__version__ = "0.1.0"
