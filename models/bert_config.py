"""BERT sizes: Google's `bert_config.json` keys, presets from tiny to large.

Presets follow Google's released BERT family (Turc et al., 2019): L layers,
H hidden, H/64 heads, 4H intermediate. Every size is a multiple of 8 (tensor
cores).
"""

import dataclasses
import json

KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "hidden_act", "hidden_dropout_prob",
        "attention_probs_dropout_prob", "max_position_embeddings",
        "type_vocab_size", "initializer_range")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Google's `bert_config.json`, field for field."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in ("gelu", "relu", "tanh", "gelu_new"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_dict(cls, values: dict) -> "BertConfig":
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads") if k not in values]
        if missing:
            raise ValueError(f"BERT config lacks {missing}")
        return cls(**{k: values[k] for k in KEYS if k in values})

    @classmethod
    def from_json_file(cls, path: str) -> "BertConfig":
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read BERT config {path}: {e}") from None
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"BERT config {path}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _preset(layers, hidden):
    return dict(num_hidden_layers=layers, hidden_size=hidden,
                num_attention_heads=max(1, hidden // 64),
                intermediate_size=4 * hidden)


PRESETS = {
    "bert_tiny": _preset(2, 128),
    "bert_mini": _preset(4, 256),
    "bert_small": _preset(4, 512),
    "bert_medium": _preset(8, 512),
    "bert_base": _preset(12, 768),
    "bert_large": _preset(24, 1024),
}


def preset(name: str, **overrides) -> BertConfig:
    """A named size, e.g. preset("bert_tiny", vocab_size=8000)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(PRESETS)}")
    return BertConfig(**{**PRESETS[name], **overrides})
