"""BERT pretraining, from a checkout: `python run_pretraining.py --flags`
(Google's and NVIDIA's command lines work unchanged). The code and its
flags: `models/tasks/run_pretraining.py`; installed, the console script is
`tfscale-pretrain`."""

from models.tasks.run_pretraining import run

if __name__ == "__main__":
    run()
