"""A folder of images -> sharded ImageNet-format records.

The library behind `build_image_records` (its command line). The folder
holds one folder per class (ImageNet's train layout), or it is flat with a
file naming each image's class (ImageNet's validation layout:
ILSVRC2012_val_*.JPEG plus imagenet_2012_validation_synset_labels.txt).
Classes are numbered in the order of a labels file (one class name per
line) or else sorted, from `label_offset`; images are shuffled with a seed
and dealt to the shards; non-JPEG images are re-encoded as JPEG; an
unreadable image is a one-line error naming it. Each shard is written under
a temporary name and renamed when complete, by writer processes (one per
core); a rerun after a crash keeps the complete shards and writes the
missing ones. `labels.txt` beside the shards lists the class of each label.
"""

import dataclasses
import os
import random
import time
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from input_pipelines import images, output_claim, record_checks, shard_writer
from input_pipelines.prepare import engine

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


class ImageFolderError(ValueError):
    """The image folder, a label file or an image is unusable (named)."""


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """What to write.

    Attributes:
        image_dir: One folder per class, or a flat folder of images when
            `image_labels_file` is given.
        output_dir: Where the record files and labels.txt go.
        name: Prefix of the record files ("train", "validation").
        num_shards: Record files to write.
        label_offset: Label of the first class.
        labels_file: Class names in label order (default: sorted).
        image_labels_file: One class name per image of a flat `image_dir`,
            in the sorted order of the image file names (ImageNet's
            imagenet_2012_validation_synset_labels.txt).
        metadata_file: "synset<TAB>human text" lines (ImageNet's
            imagenet_metadata.txt) for image/class/text.
        bounding_box_file: "file,xmin,ymin,xmax,ymax" lines (fractions;
            TF-slim's process_bounding_boxes.py output).
        seed: Seed of the shuffle of all images before sharding.
        num_processes: Processes writing shards at once; 0: one per core,
            but one per `IMAGES_PER_PROCESS` images at most (each process
            imports TensorFlow, a few seconds); 1 writes in this process.
        scheduler, scheduler_file: Write on a running Dask scheduler's
            workers instead (`prepare/engine.py`).
        worker_memory: Each local writer process's memory limit (Dask's
            words: "2GB", "auto").
        jpeg_quality: Quality of re-encoded non-JPEG images.
    """

    image_dir: str
    output_dir: str
    name: str = "train"
    num_shards: int = 16
    label_offset: int = 1
    labels_file: Optional[str] = None
    image_labels_file: Optional[str] = None
    metadata_file: Optional[str] = None
    bounding_box_file: Optional[str] = None
    seed: int = 12345
    num_processes: int = 0
    jpeg_quality: int = 95
    scheduler: Optional[str] = None
    scheduler_file: Optional[str] = None
    worker_memory: str = "auto"

    def __post_init__(self):
        if self.num_shards < 1 or self.num_processes < 0:
            raise ValueError("num_shards must be >= 1 and num_processes "
                             ">= 0")


def read_lines(path: str) -> List[str]:
    """The non-empty lines of a text file, stripped."""
    with tf.io.gfile.GFile(path) as f:
        return [line.strip() for line in f if line.strip()]


def _image_files(folder: str) -> List[str]:
    return sorted(f for f in tf.io.gfile.listdir(folder)
                  if f.lower().endswith(IMAGE_EXTENSIONS))


def find_images(image_dir: str, labels_file: Optional[str] = None,
                image_labels_file: Optional[str] = None
                ) -> Tuple[List[Tuple[str, int]], List[str]]:
    """([(path, class index)], class names) of a folder of class folders,
    or of a flat folder whose images' classes `image_labels_file` lists."""
    if not tf.io.gfile.isdir(image_dir):
        raise ImageFolderError(f"--image_dir {image_dir}: not a directory")
    classes = read_lines(labels_file) if labels_file else None
    if image_labels_file:
        return _find_flat(image_dir, image_labels_file, classes, labels_file)
    folders = sorted(d.rstrip("/") for d in tf.io.gfile.listdir(image_dir)
                     if tf.io.gfile.isdir(os.path.join(image_dir, d)))
    if classes is not None:
        missing = sorted(set(folders) - set(classes))
        if missing:
            raise ImageFolderError(
                f"--labels_file {labels_file} does not list folder "
                f"{missing[0]!r} of --image_dir ({len(missing)} missing)")
    else:
        classes = folders
    if not classes:
        raise ImageFolderError(
            f"--image_dir {image_dir}: no class folders (a flat folder of "
            "images needs --image_labels_file)")
    found = []
    for index, name in enumerate(classes):
        folder = os.path.join(image_dir, name)
        if not tf.io.gfile.isdir(folder):
            continue  # a class of the labels file without images here
        found += [(os.path.join(folder, f), index)
                  for f in _image_files(folder)]
    if not found:
        raise ImageFolderError(f"--image_dir {image_dir}: no images "
                               f"({', '.join(IMAGE_EXTENSIONS)}) in its "
                               "class folders")
    return found, classes


def _find_flat(image_dir: str, image_labels_file: str,
               classes: Optional[List[str]], labels_file: Optional[str]
               ) -> Tuple[List[Tuple[str, int]], List[str]]:
    files = _image_files(image_dir)
    names = read_lines(image_labels_file)
    if len(names) != len(files):
        raise ImageFolderError(
            f"--image_labels_file {image_labels_file}: {len(names)} lines for "
            f"{len(files)} images in --image_dir {image_dir} (one class per "
            "image, in the sorted order of the file names)")
    if not files:
        raise ImageFolderError(f"--image_dir {image_dir}: no images "
                               f"({', '.join(IMAGE_EXTENSIONS)})")
    if classes is None:
        classes = sorted(set(names))
    index = {name: i for i, name in enumerate(classes)}
    for number, name in enumerate(names, 1):
        if name not in index:
            raise ImageFolderError(
                f"--image_labels_file {image_labels_file}: line {number}: "
                f"class {name!r} is not in --labels_file {labels_file}")
    return ([(os.path.join(image_dir, f), index[name])
             for f, name in zip(files, names)], classes)


def read_metadata(path: Optional[str]) -> Dict[str, str]:
    """synset -> human-readable text, from "synset<TAB>text" lines."""
    if not path:
        return {}
    text = {}
    with tf.io.gfile.GFile(path) as f:
        for line in f:
            if "\t" in line:
                synset, human = line.rstrip("\n").split("\t", 1)
                text[synset] = human
    return text


def read_boxes(path: Optional[str]) -> Dict[str, List[Tuple[float, ...]]]:
    """file name -> [(ymin, xmin, ymax, xmax)], from TF-slim's CSV
    "file,xmin,ymin,xmax,ymax" (fractions of the image)."""
    if not path:
        return {}
    boxes = {}
    with tf.io.gfile.GFile(path) as f:
        for number, line in enumerate(f, 1):
            parts = line.strip().split(",")
            if len(parts) != 5:
                if line.strip():
                    raise ImageFolderError(
                        f"--bounding_box_file {path}: line {number}: expected "
                        f"'file,xmin,ymin,xmax,ymax', got {line.strip()!r}")
                continue
            xmin, ymin, xmax, ymax = (float(v) for v in parts[1:])
            boxes.setdefault(parts[0], []).append((ymin, xmin, ymax, xmax))
    return boxes


def encode(path: str, jpeg_quality: int) -> Tuple[bytes, int, int]:
    """An image file -> (JPEG bytes, height, width)."""
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    try:
        if tf.io.is_jpeg(data):
            height, width, _ = tf.image.extract_jpeg_shape(data).numpy()
            tf.io.decode_jpeg(data, channels=3, ratio=8)  # readable at all?
            return data, int(height), int(width)
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
    except tf.errors.InvalidArgumentError as e:
        raise ImageFolderError(f"{path}: not a readable image "
                               f"({record_checks.op_message(e)})") from None
    jpeg = tf.io.encode_jpeg(image, quality=jpeg_quality).numpy()
    return jpeg, int(image.shape[0]), int(image.shape[1])


def _check_no_other_shards(config: WriterConfig, names: List[str]):
    """Shards of an earlier run with another shard count would be read too
    (`NAME-*`): a silent duplicate of the data."""
    other = shard_writer.other_shards(
        os.path.join(config.output_dir, f"{config.name}-*-of-*"), names)
    if other:
        raise ImageFolderError(
            f"--output_dir {config.output_dir} already holds {other[0]} "
            f"({len(other)} files not from this --num_shards={len(names)}); "
            "remove them or choose another --name")


IMAGES_PER_PROCESS = 5000  # about 13 s of writing per process start (5 s)


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What `build` did: every shard's name, and how much it wrote."""

    names: List[str]
    images_written: int
    images_kept: int
    shards_kept: int
    seconds: float
    leftovers_removed: int = 0  # files of attempts that died (a worker)

    @property
    def images_per_second(self) -> float:
        return self.images_written / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class _ShardTask:
    """One shard to write (picklable: it goes to a writer process)."""

    name: str
    items: Tuple[Tuple[str, int], ...]   # (image path, class index)
    classes: Tuple[str, ...]
    texts: Dict[str, str]
    boxes: Dict[str, tuple]
    label_offset: int
    jpeg_quality: int


def _write_shard(task: _ShardTask, progress) -> int:
    """Writes one shard (a module-level function: it runs in writer
    processes)."""
    def records():
        for path, index in task.items:
            jpeg, height, width = encode(path, task.jpeg_quality)
            synset = task.classes[index]
            file = os.path.basename(path)
            yield images.serialize_example(
                jpeg, index + task.label_offset, height, width,
                synset=synset, text=task.texts.get(synset, ""),
                filename=file, boxes=task.boxes.get(file, ()))
    return shard_writer.write_shard(task.name, records(), progress)


def build(config: WriterConfig, show_progress: bool = False) -> WriteResult:
    """Writes the shards and labels.txt.

    A rerun with the same images and settings (the same digest in
    `.NAME.manifest.json`; it covers every image's path, label, size and
    mtime) keeps the shards an earlier run completed and writes only the
    missing ones: the same bytes as an uninterrupted run. The output is
    claimed first (`output_claim`): a second writer of it refuses.

    Args:
        config: What to write.
        show_progress: A progress bar (images, rate, ETA) on stderr.
    """
    tf.io.gfile.makedirs(config.output_dir)
    if "://" in config.output_dir:  # no locks there: one writer is yours
        return _build(config, show_progress, None)
    with output_claim.claim(config.output_dir, config.name,
                            "build_image_records") as held:
        return _build(config, show_progress, held)


def _build(config: WriterConfig, show_progress: bool,
           held: Optional[output_claim.Held]) -> WriteResult:
    start = time.monotonic()
    found, classes = find_images(config.image_dir, config.labels_file,
                                 config.image_labels_file)
    metadata = read_metadata(config.metadata_file)
    boxes = read_boxes(config.bounding_box_file)
    random.Random(config.seed).shuffle(found)
    tf.io.gfile.makedirs(config.output_dir)
    shards = min(config.num_shards, len(found))
    names = [os.path.join(config.output_dir,
                          f"{config.name}-{i:05d}-of-{shards:05d}")
             for i in range(shards)]
    _check_no_other_shards(config, names)
    labels_txt = os.path.join(config.output_dir, "labels.txt")
    if (tf.io.gfile.exists(labels_txt)
            and read_lines(labels_txt) != list(classes)):
        raise ImageFolderError(
            f"{labels_txt} numbers other classes than these images would "
            f"get; pass --labels_file={labels_txt} to number them the same "
            "way, or choose another --output_dir")
    tasks = [_ShardTask(name, items, tuple(classes),
                        {k: v for k, v in metadata.items()
                         if k in {classes[i] for _, i in items}},
                        {k: tuple(v) for k, v in boxes.items()
                         if k in {os.path.basename(p) for p, _ in items}},
                        config.label_offset, config.jpeg_quality)
             for name, items in zip(names, (
                 tuple((path, index) for path, index in found[i::shards])
                 for i in range(shards)))]
    plan = _plan(config, names, tasks)
    if held:
        held.note_plan(plan.digest)
    try:
        kept = plan.keep()
    except shard_writer.OutputError as e:
        raise ImageFolderError(str(e)) from None
    todo = [tasks[i] for i in range(shards) if i not in kept]
    kept_images = sum(len(tasks[i].items) for i in kept)
    leftovers = shard_writer.remove_leftovers(names)
    try:
        written = sum(engine.run(
            todo, _write_shard, config=engine.EngineConfig(
                config.scheduler, config.scheduler_file,
                config.num_processes, config.worker_memory),
            work=[len(t.items) for t in todo],
            work_per_process=IMAGES_PER_PROCESS,
            describe=lambda t: os.path.basename(t.name),
            show_progress=show_progress, unit="image", initial=kept_images))
    except BaseException as e:
        # The engine stops the running tasks after an error and waits for
        # them; unless some still run, what they left half-written goes.
        if not engine.still_running(e):
            shard_writer.remove_leftovers(names)
        raise
    leftovers += shard_writer.remove_leftovers(names)
    with tf.io.gfile.GFile(labels_txt, "w") as f:
        f.write("".join(f"{name}\n" for name in classes))
    return WriteResult(names, written, kept_images, len(kept),
                       time.monotonic() - start, leftovers)


def _plan(config: WriterConfig, names: List[str],
          tasks: List[_ShardTask]) -> shard_writer.Plan:
    """The run's plan: the images by path, label, size and modification
    time (an image redone in place between a killed run and its rerun is
    another plan), and every setting the bytes depend on."""
    return shard_writer.Plan(
        os.path.join(config.output_dir, f".{config.name}.manifest.json"),
        names, shard_writer.Plan.digest_of([
            [os.path.basename(t.name), t.items, _stats(t.items),
             t.label_offset, t.jpeg_quality, sorted(t.texts.items()),
             sorted((k, [list(b) for b in v]) for k, v in t.boxes.items())]
            for t in tasks]))


def _stats(items) -> list:
    """(size, mtime_ns) of each image: what changes when it is redone."""
    stats = []
    for path, _ in items:
        info = os.stat(path) if "://" not in path else None
        stats.append([info.st_size, info.st_mtime_ns] if info else
                     [tf.io.gfile.stat(path).length,
                      tf.io.gfile.stat(path).mtime_nsec])
    return stats


def write_records(config: WriterConfig) -> List[str]:
    """Writes the shards and labels.txt (see `build`); returns the shard
    file names."""
    return build(config).names
