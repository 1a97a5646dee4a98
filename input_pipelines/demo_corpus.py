"""The demo corpus's text and model, with no flags (make_demo_corpus.py is
the command that writes them; tests and benchmarks call these directly).

The text is Python's own language reference help (`pydoc_data.topics`, about
450k characters, shipped with every CPython): each help topic a document of
sentences.
"""

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def corpus_documents() -> list:
    """Help topics -> documents (lists of sentences)."""
    from pydoc_data.topics import topics
    documents = []
    for name in sorted(topics):
        sentences = []
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(line.strip() for line in paragraph.splitlines())
            text = re.sub(r"\s+", " ", text).strip()
            if len(text) < 20 or text.startswith(("*", "=", "-")):
                continue
            sentences.extend(s for s in _SENTENCE_END.split(text) if len(s) > 3)
        if len(sentences) >= 2:
            documents.append(sentences)
    return documents


def tiny_bert_config(vocab_size: int) -> dict:
    """Google's bert_config.json keys for BERT-tiny (2 layers, 128 hidden)."""
    return {"vocab_size": vocab_size, "hidden_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 512, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
            "max_position_embeddings": 512, "type_vocab_size": 2,
            "initializer_range": 0.02}
