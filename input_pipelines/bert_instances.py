"""Pretraining instances from tokenized documents (Google BERT's algorithm).

Sentence-pair sampling with 50% random next sentences and `short_seq_prob`
shorter targets; 15% masking (80% [MASK], 10% random token, 10% unchanged);
`dupe_factor` passes with different masks. WordPiece tokenization and
vocabulary learning are tensorflow-text's. The entry point with flags is
`create_pretraining_data`.
"""

import dataclasses
import os
import random
from typing import List, Sequence

RESERVED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10


@dataclasses.dataclass
class Instance:
    tokens: List[int]
    segment_ids: List[int]
    masked_lm_positions: List[int]
    masked_lm_ids: List[int]
    is_random_next: bool


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    mask: int
    vocab_size: int


def truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    """Trims the longer sequence, from a random end, until the pair fits."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def mask_tokens(tokens: List[int], config: InstanceConfig, ids: SpecialIds,
                rng: random.Random):
    """Google's masking: (masked tokens, positions, original ids)."""
    candidates = [i for i, t in enumerate(tokens) if t not in (ids.cls, ids.sep)]
    rng.shuffle(candidates)
    num = min(config.max_predictions_per_seq,
              max(1, int(round(len(tokens) * config.masked_lm_prob))))
    output = list(tokens)
    chosen = sorted(candidates[:num])
    for index in chosen:
        if rng.random() < 0.8:
            output[index] = ids.mask
        elif rng.random() < 0.5:
            pass  # keep the original token
        else:
            output[index] = rng.randint(0, ids.vocab_size - 1)
    return output, chosen, [tokens[i] for i in chosen]


def instances_from_document(documents, index, config: InstanceConfig,
                            ids: SpecialIds, rng: random.Random):
    """Sentence-pair instances of one document (Google's algorithm)."""
    document = documents[index]
    max_num_tokens = config.max_seq_length - 3
    target = max_num_tokens
    if rng.random() < config.short_seq_prob:
        target = rng.randint(2, max_num_tokens)
    instances, chunk, length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            if chunk:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                tokens_a = [t for s in chunk[:a_end] for t in s]
                tokens_b = []
                is_random_next = len(chunk) == 1 or rng.random() < 0.5
                if is_random_next and len(documents) > 1:
                    target_b = max(1, target - len(tokens_a))
                    other = index
                    for _ in range(10):
                        other = rng.randint(0, len(documents) - 1)
                        if other != index:
                            break
                    random_doc = documents[other]
                    start = rng.randint(0, len(random_doc) - 1)
                    for sentence in random_doc[start:]:
                        tokens_b.extend(sentence)
                        if len(tokens_b) >= target_b:
                            break
                    # Put the unused segments back for the next instance.
                    i -= len(chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = [t for s in chunk[a_end:] for t in s]
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:
                    tokens = [ids.cls] + tokens_a + [ids.sep] + tokens_b + [ids.sep]
                    segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                    masked, positions, labels = mask_tokens(tokens, config, ids, rng)
                    instances.append(Instance(masked, segments, positions,
                                              labels, is_random_next))
            chunk, length = [], 0
        i += 1
    return instances


def create_instances(documents, config: InstanceConfig, ids: SpecialIds,
                     rng: random.Random, progress=None) -> List[Instance]:
    """All instances: `dupe_factor` passes over every document, shuffled.
    `progress(n)` (optional) hears of every 64 documents done."""
    documents = [d for d in documents if d]
    instances = []
    done = 0
    for _ in range(config.dupe_factor):
        for index in range(len(documents)):
            instances.extend(instances_from_document(documents, index, config,
                                                     ids, rng))
            done += 1
            if progress and done == 64:
                progress(done)
                done = 0
    if progress:
        progress(done)
    rng.shuffle(instances)
    return instances


def build_vocab(lines: Sequence[str], vocab_size: int, lower_case=True) -> list:
    """Learns a WordPiece vocabulary with tensorflow-text."""
    import tensorflow as tf
    from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset
    dataset = tf.data.Dataset.from_tensor_slices(
        [line for line in lines if line.strip()]).batch(1000)
    return bert_vocab_from_dataset.bert_vocab_from_dataset(
        dataset, vocab_size=vocab_size, reserved_tokens=list(RESERVED_TOKENS),
        bert_tokenizer_params={"lower_case": lower_case}, learn_params={})


def load_vocab(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        vocab = [line.rstrip("\n") for line in f]
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[UNK]") if t not in vocab]
    if missing:
        raise ValueError(f"vocab file {path} lacks {missing}")
    return vocab


def tokenize(sentences: Sequence[str], vocab_file: str, lower_case=True):
    """Sentences -> lists of WordPiece ids (tensorflow-text, batched)."""
    import tensorflow as tf
    import tensorflow_text as text
    tokenizer = text.BertTokenizer(vocab_file, lower_case=lower_case,
                                   token_out_type=tf.int64)
    ids = []
    for start in range(0, len(sentences), 4096):
        batch = tf.constant(list(sentences[start:start + 4096]))
        ids.extend(tokenizer.tokenize(batch).merge_dims(-2, -1).to_list())
    return ids


def shard_names(output_file: str, num_shards: int) -> list:
    stem, ext = os.path.splitext(output_file)
    return [f"{stem}-{i:05d}-of-{num_shards:05d}{ext}" for i in range(num_shards)]


def serialized(instances, spec):
    from input_pipelines.bert_records import serialize_instance
    for inst in instances:
        yield serialize_instance(inst.tokens, inst.segment_ids,
                                 inst.masked_lm_positions, inst.masked_lm_ids,
                                 inst.is_random_next, spec)


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One output shard: bucket `bucket` of the bucketed corpus in `workdir`
    (`prepare/buckets.py`, `files` parts) and how to make instances of its
    documents (picklable: it goes to a worker)."""

    name: str
    workdir: str
    files: int
    bucket: int
    vocab_file: str
    lower_case: bool
    config: InstanceConfig
    ids: SpecialIds
    seed: str
    spec: object


def write_instance_shard(task: ShardTask, progress) -> tuple:
    """Reads the shard's bucket, tokenizes its documents, makes their
    instances with the shard's own random stream (random next sentences
    come from the same shard's documents, which are drawn from every input
    file) and writes them. Returns (documents, instances)."""
    from input_pipelines.prepare import buckets
    sources = buckets.read_bucket(task.workdir, task.files, task.bucket)
    sentences = [s for d in sources for s in d]
    tokens = iter(tokenize(sentences, task.vocab_file, task.lower_case))
    documents = [[t for t in (next(tokens) for _ in d) if t]
                 for d in sources]
    instances = create_instances(documents, task.config, task.ids,
                                 random.Random(task.seed), progress)
    from input_pipelines import shard_writer
    shard_writer.write_shard(task.name, serialized(instances, task.spec),
                             lambda n: None)
    return len(sources), len(instances)
