# tfscale: two commands.
#   make demo   build a small real corpus into BERT records, pretrain BERT-tiny
#               with 2 local workers, print the summary
#   make test   run the test suite
#   (make test-quick: the unit tests only, about 5 minutes;
#    make demo-images: ResNet-50 on generated JPEG records, 2 workers)
# Each creates ./.venv (unless a virtualenv is active) and installs what it needs.

PYTHON ?= python3
VENV ?= .venv
ifdef VIRTUAL_ENV
PY := python
else
PY := $(VENV)/bin/python
endif
DEMO_DIR ?= runs/demo
WORKERS ?= 2

IMAGES_DIR ?= runs/images

.PHONY: demo demo-images test test-quick test-seeds install install-test clean

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else "tfscale needs Python 3.10-3.12 (setup.py python_requires); this $(PYTHON) is %d.%d: make PYTHON=python3.12" % sys.version_info[:2])'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

ifdef VIRTUAL_ENV
install:
else
install: $(VENV)/bin/python
endif
	$(PY) -m pip install -q -e ".[demo]"

ifdef VIRTUAL_ENV
install-test:
else
install-test: $(VENV)/bin/python
endif
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m input_pipelines.make_demo_corpus --output_dir=$(DEMO_DIR)/corpus
	$(PY) -m input_pipelines.create_pretraining_data \
	    --input_file=$(DEMO_DIR)/corpus/corpus.txt \
	    --vocab_file=$(DEMO_DIR)/corpus/vocab.txt \
	    --output_file=$(DEMO_DIR)/records/train.tfrecord \
	    --num_output_shards=4 --max_seq_length=64 --max_predictions_per_seq=10 \
	    --dupe_factor=5 --random_seed=12345
	rm -rf $(DEMO_DIR)/model
	$(PY) -m launch.local --num_workers $(WORKERS) -- \
	    $(PY) run_pretraining.py \
	    --input_file='$(DEMO_DIR)/records/train-*.tfrecord' \
	    --output_dir=$(DEMO_DIR)/model \
	    --bert_config_file=$(DEMO_DIR)/corpus/bert_config.json \
	    --max_seq_length=64 --max_predictions_per_seq=10 \
	    --train_batch_size=64 --learning_rate=2e-3 --optimizer=lamb \
	    --num_train_steps=300 --num_warmup_steps=30 \
	    --save_checkpoints_steps=100 --log_steps=25

# ResNet-50 on patterned JPEGs (ImageNet's record format), 2 local workers.
demo-images: install
	$(PY) -m input_pipelines.make_demo_images --output_dir=$(IMAGES_DIR) \
	    --num_classes=10 --images_per_class=100 --eval_images_per_class=10
	rm -rf $(IMAGES_DIR)/model
	$(PY) -m launch.local --num_workers $(WORKERS) -- \
	    $(PY) train_image_classifier.py \
	    --train_files='$(IMAGES_DIR)/records/train-*' \
	    --eval_files='$(IMAGES_DIR)/records/validation-*' \
	    --output_dir=$(IMAGES_DIR)/model --num_classes=10 --image_size=64 \
	    --train_batch_size=32 --num_train_steps=100 --num_warmup_steps=10 \
	    --precision=mixed_bfloat16 --save_checkpoints_steps=50 --log_steps=10

# Two pytest workers (pytest-xdist), a test file each at a time: the
# multi-process tests leave a core idle while a worker imports TensorFlow or
# waits on its peers. TEST_JOBS=1 runs the files one after another.
TEST_JOBS ?= 2
test: install-test
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

# Unit tests in one process (no worker processes, no clusters), the files
# docs/tests.md marks quick: about 5 minutes on 2 cores.
QUICK_TESTS = tests/test_benchmark_models.py tests/test_benchmarks.py \
	tests/test_bert.py tests/test_deterministic_step.py \
	tests/test_bert_pretraining.py tests/test_cluster.py tests/test_compat.py \
	tests/test_entry_points.py \
	tests/test_docs.py tests/test_elastic.py tests/test_elementwise.py tests/test_fit_arguments.py \
	tests/test_google_checkpoints.py tests/test_gpu_binding.py tests/test_gpu_check.py \
	tests/test_gpus.py tests/test_horovod.py \
	tests/test_input_pipeline.py tests/test_jobs.py tests/test_launch.py \
	tests/test_layout.py tests/test_levers.py tests/test_mpi.py tests/test_nvidia_flags.py \
	tests/test_optim.py tests/test_placement.py tests/test_planning.py tests/test_record_order.py tests/test_scaling.py \
	tests/test_step_row.py tests/test_stragglers.py tests/test_tfds_source.py tests/test_trainer.py tests/test_xla_flags.py \
	tests/test_xplane_top.py tests/test_zero.py

test-quick: install-test
	$(PY) -m pytest -q -m "not slow" $(QUICK_TESTS)

# The noise-scale and AdaScale tests at global seeds 0-19 (about 30 min):
# a test whose outcome depends on the seed fails at some of them.
test-seeds: install-test
	$(PY) -m tests.seed_sweep --seeds 20

clean:
	rm -rf runs .pytest_cache
