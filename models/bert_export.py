"""Trained BERT for downstream use: export and load.

An export directory holds

    bert_config.json             Google's config keys
    bert_pretrainer.weights.h5   the whole pretraining model (encoder + heads)
    encoder.weights.h5           the encoder alone: what fine-tuning starts from

Keras `.weights.h5` files, loaded into a model built from the config:

    encoder = bert_export.load_encoder("runs/bert/export")
    sequence_output, pooled_output = encoder(inputs)
"""

import json
import os

from models import bert
from models.bert_config import BertConfig
from tfscale import durable

CONFIG_FILE = "bert_config.json"
PRETRAINER_FILE = "bert_pretrainer.weights.h5"
ENCODER_FILE = "encoder.weights.h5"


def export(model: bert.BertPretrainer, output_dir: str) -> str:
    """Writes `model` (and its encoder) to `output_dir`; returns the dir.

    Each file is written beside its name and renamed into place
    (`tfscale.durable.commit`): a process killed mid-export (a scheduler's
    SIGKILL) leaves every file whole, the old one or the new, and a write
    that fails (a full disk) removes its partial file and names its path.
    """
    os.makedirs(output_dir, exist_ok=True)

    def write_config(path):
        with open(path, "w") as f:
            json.dump(model.config.to_dict(), f, indent=2)

    durable.commit(write_config, os.path.join(output_dir, CONFIG_FILE))
    for layer, name in ((model, PRETRAINER_FILE),
                        (model.encoder, ENCODER_FILE)):
        durable.commit(layer.save_weights, os.path.join(output_dir, name))
    return output_dir


def load_config(export_dir: str) -> BertConfig:
    return BertConfig.from_json_file(os.path.join(export_dir, CONFIG_FILE))


def load_encoder(export_dir: str, max_seq_length: int = 128) -> bert.BertEncoder:
    """The exported encoder, built and loaded."""
    encoder = bert.make_encoder(load_config(export_dir), max_seq_length)
    encoder.load_weights(os.path.join(export_dir, ENCODER_FILE))
    return encoder


def load_pretrainer(export_dir: str, max_seq_length: int,
                    max_predictions_per_seq: int) -> bert.BertPretrainer:
    """The exported pretraining model, built and loaded."""
    model = bert.make_pretrainer(load_config(export_dir), max_seq_length,
                                 max_predictions_per_seq)
    model.load_weights(os.path.join(export_dir, PRETRAINER_FILE))
    return model
