"""Export a BERT checkpoint of run_pretraining.py as Keras weight files
and Google's TF1 checkpoint (no SavedModel), from a checkout: `python
export_bert.py --flags` (`--help` lists them). The code and its flags: `models/tasks/export_bert.py`; installed, the console script
is `tfscale-export-bert`."""

from models.tasks.export_bert import run

if __name__ == "__main__":
    run()
