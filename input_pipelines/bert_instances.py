"""Pretraining instances from tokenized documents (Google BERT's algorithm).

Sentence-pair sampling with 50% random next sentences and `short_seq_prob`
shorter targets; 15% masking (80% [MASK], 10% random token, 10% unchanged);
`dupe_factor` passes with different masks. WordPiece tokenization and
vocabulary learning are tensorflow-text's. The entry point with flags is
`create_pretraining_data`.
"""

import array
import dataclasses
import glob
import os
import random
import struct
import uuid
from typing import Iterator, List, Sequence

from input_pipelines import extras

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


def iter_instances(documents, config: InstanceConfig, ids: SpecialIds,
                   rng: random.Random, progress=None) -> Iterator[Instance]:
    """The instances of `dupe_factor` passes over every (non-empty)
    document, in the order they are made. `progress(n)` (optional) hears of
    every 64 documents done."""
    done = 0
    for _ in range(config.dupe_factor):
        for index in range(len(documents)):
            yield from instances_from_document(documents, index, config, ids,
                                               rng)
            done += 1
            if progress and done == 64:
                progress(done)
                done = 0
    if progress:
        progress(done)


def create_instances(documents, config: InstanceConfig, ids: SpecialIds,
                     rng: random.Random, progress=None) -> List[Instance]:
    """All instances, shuffled (Google's order; in memory)."""
    documents = [d for d in documents if d]
    instances = list(iter_instances(documents, config, ids, rng, progress))
    rng.shuffle(instances)
    return instances


def build_vocab(lines: Sequence[str], vocab_size: int, lower_case=True) -> list:
    """Learns a WordPiece vocabulary with tensorflow-text."""
    import tensorflow as tf
    bert_vocab_from_dataset = extras.require(
        "tensorflow_text.tools.wordpiece_vocab.bert_vocab_from_dataset",
        "text")
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
    tokenizer = _tokenizer(vocab_file, lower_case)
    ids = []
    for start in range(0, len(sentences), TOKENIZE_BATCH):
        ids.extend(_tokenize(tokenizer, sentences[start:start + TOKENIZE_BATCH]))
    return ids


TOKENIZE_BATCH = 4096  # sentences per tokenizer call


def _tokenizer(vocab_file: str, lower_case: bool):
    import tensorflow as tf
    text = extras.require("tensorflow_text", "text")
    return text.BertTokenizer(vocab_file, lower_case=lower_case,
                              token_out_type=tf.int32)


def _tokenize(tokenizer, sentences: Sequence[str]) -> List[List[int]]:
    import tensorflow as tf
    return tokenizer.tokenize(tf.constant(list(sentences))).merge_dims(
        -2, -1).to_list()


class TokenStore:
    """Tokenized documents in a file of int32 ids, read back one document
    at a time (`store[i]`: a list of sentences, each a list of ids): a
    shard's documents take 16 bytes a sentence in memory, not their
    tokens. Random next sentences need any document of the shard at any
    time, as in Google's tool, which holds them all.
    """

    def __init__(self, path: str):
        self._path = path
        self._file = open(path, "w+b")
        self._sentence_ends = array.array("q")  # token offsets
        self._document_ends = array.array("q", [0])  # sentence offsets
        self.tokens = 0
        self._unflushed = False

    def add(self, sentences: List[List[int]]) -> None:
        """Appends one document (empty sentences dropped; an empty document
        is not stored)."""
        sentences = [s for s in sentences if s]
        if not sentences:
            return
        for sentence in sentences:
            self._file.write(array.array("i", sentence).tobytes())
            self.tokens += len(sentence)
            self._sentence_ends.append(self.tokens)
        self._document_ends.append(len(self._sentence_ends))
        self._unflushed = True

    def __len__(self) -> int:
        return len(self._document_ends) - 1

    def __getitem__(self, index: int) -> List[List[int]]:
        if self._unflushed:
            self._file.flush()  # pread reads the file, not the buffer
            self._unflushed = False
        first, last = self._document_ends[index], self._document_ends[index + 1]
        start = self._sentence_ends[first - 1] if first else 0
        ids = array.array("i")
        ids.frombytes(os.pread(self._file.fileno(),
                               4 * (self._sentence_ends[last - 1] - start),
                               4 * start))
        sentences, at = [], 0
        for end in self._sentence_ends[first:last]:
            sentences.append(ids[at:end - start].tolist())
            at = end - start
        return sentences

    def close(self) -> None:
        self._file.close()
        os.remove(self._path)


def _tokenized(tokenizer, sources, store: TokenStore, progress) -> None:
    """Tokenizes documents into `store`, TOKENIZE_BATCH sentences a call."""
    batch: List[List[str]] = []

    def flush():
        if not batch:
            return
        ids = iter(_tokenize(tokenizer, [s for d in batch for s in d]))
        for document in batch:
            store.add([next(ids) for _ in document])
        batch.clear()
        progress(0)
    sentences = 0
    for document in sources:
        batch.append(document)
        sentences += len(document)
        if sentences >= TOKENIZE_BATCH:
            flush()
            sentences = 0
    flush()


# Instances are shuffled through spill files of about this size: a shard of
# any size takes one spill's records in memory (and the spill buffers).
SPILL_BYTES = 16 << 20
_BUFFER_BYTES = 4 << 20


def shuffled(records: Iterator[bytes], spills: int, rng: random.Random,
             assign: random.Random, stem: str) -> Iterator[bytes]:
    """`records` in a uniformly random order, holding about 1/`spills` of
    them at a time: each record goes to a random one of `spills` files
    (`assign`), then each file's records are shuffled (`rng`) in turn. With
    one spill this is `rng.shuffle` of the list, in memory, as Google's
    tool does."""
    buffers: List[List[bytes]] = [[] for _ in range(spills)]
    paths = [f"{stem}.spill-{k}.incomplete" for k in range(spills)]
    buffered = 0
    try:
        for record in records:
            k = assign.randrange(spills) if spills > 1 else 0
            buffers[k].append(record)
            buffered += len(record)
            if spills > 1 and buffered >= _BUFFER_BYTES:
                for path, buffer in zip(paths, buffers):
                    _append_spill(path, buffer)
                    buffer.clear()
                buffered = 0
        for path, buffer in zip(paths, buffers):
            if not os.path.exists(path):  # one spill: Google's shuffle
                rng.shuffle(buffer)
                yield from buffer
                buffer.clear()
                continue
            _append_spill(path, buffer)
            buffer.clear()
            with open(path, "rb") as f:
                data = f.read()
            os.remove(path)
            # The spill's bytes and their offsets, not a list of records.
            offsets, at = [], 0
            while at < len(data):
                (size,) = struct.unpack_from("<I", data, at)
                offsets.append((at + 4, at + 4 + size))
                at += 4 + size
            rng.shuffle(offsets)
            view = memoryview(data)
            for start, end in offsets:
                yield bytes(view[start:end])
            del view, data
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


def _append_spill(path: str, records: List[bytes]) -> None:
    if records:
        with open(path, "ab") as f:
            f.write(b"".join(struct.pack("<I", len(r)) + r for r in records))


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
    (`prepare/buckets.py`: its (part, start, end) `ranges`) and how to make
    instances of its documents (picklable: it goes to a worker)."""

    name: str
    workdir: str
    ranges: tuple
    vocab_file: str
    lower_case: bool
    config: InstanceConfig
    ids: SpecialIds
    seed: str
    spec: object
    piece_bytes: int


def write_instance_shard(task: ShardTask, progress) -> tuple:
    """Reads the shard's bucket a piece at a time, tokenizes its documents
    into a `TokenStore`, makes their instances with the shard's own random
    stream (random next sentences come from the same shard's documents,
    which are drawn from every input file) and streams them, shuffled
    through spill files, to the writer. Returns (documents, instances).
    The bytes are those of Google's in-memory order when the shard's
    records fit in one spill (SPILL_BYTES)."""
    from input_pipelines import shard_writer
    from input_pipelines.bert_records import serialize_instance
    from input_pipelines.prepare import buckets
    stem = os.path.join(task.workdir, f"{os.path.basename(task.name)}."
                                      f"{uuid.uuid4().hex}")
    store = TokenStore(f"{stem}.tokens.incomplete")
    sources = [0]

    def counted():
        for document in buckets.read_bucket(task.workdir, task.ranges,
                                            task.piece_bytes):
            sources[0] += 1
            yield document
    try:
        _tokenized(_tokenizer(task.vocab_file, task.lower_case), counted(),
                   store, progress)
        rng = random.Random(task.seed)
        full = serialize_instance([0] * task.config.max_seq_length,
                                  [0] * task.config.max_seq_length,
                                  [0] * task.config.max_predictions_per_seq,
                                  [0] * task.config.max_predictions_per_seq,
                                  False, task.spec)
        # About one instance per (max_seq_length - 3) tokens and per
        # document and pass; the spill count follows from the data alone,
        # so the bytes do not depend on any memory setting.
        estimate = task.config.dupe_factor * (
            store.tokens // max(1, task.config.max_seq_length - 3)
            + len(store)) * len(full)
        spills = max(1, -(-estimate // SPILL_BYTES))
        made = [0]

        def records():
            for inst in iter_instances(store, task.config, task.ids, rng,
                                       progress):
                made[0] += 1
                yield serialize_instance(
                    inst.tokens, inst.segment_ids, inst.masked_lm_positions,
                    inst.masked_lm_ids, inst.is_random_next, task.spec)
        shard_writer.write_shard(
            task.name, shuffled(records(), spills, rng,
                                random.Random(f"{task.seed}/spills"), stem),
            lambda n: None)
    finally:
        store.close()
        for leftover in glob.glob(glob.escape(stem) + ".*incomplete"):
            os.remove(leftover)
    return sources[0], made[0]
