"""Export a BERT checkpoint, from a checkout: `python export_bert.py --flags`
(Google's and NVIDIA's command lines work unchanged). The code and its
flags: `models/tasks/export_bert.py`; installed, the console script is
`tfscale-export-bert`."""

from models.tasks.export_bert import run

if __name__ == "__main__":
    run()
