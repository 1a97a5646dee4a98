"""The jobs: a model and its records as `tfscale.jobs.Task`s, run by the
shared skeleton (`tfscale/jobs.py`).

`pretraining` (BERT) and `image_classification` (ResNet-50) are the jobs,
on `records.RecordsTask` (what a job over TFRecords adds to the skeleton);
`run_pretraining`, `train_image_classifier` and `export_bert` their absl
entry points (console scripts `tfscale-pretrain`, `tfscale-train-images`,
`tfscale-export-bert`; the checkout's root `run_pretraining.py` and
`train_image_classifier.py` run them too). A job joins a model with its
input pipeline, so this subpackage, beside the models, is the one place
allowed to import both `models` and `input_pipelines`; the engine
(`tfscale`) knows neither, and the models do not know their records.
"""
