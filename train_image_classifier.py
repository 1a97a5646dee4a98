"""ResNet-50 on ImageNet-format records (TF-slim's format), from a checkout:
`python train_image_classifier.py --flags` (docs/image-job.md lists them).
The code and its flags: `models/tasks/train_image_classifier.py`; installed,
the console script is `tfscale-train-images`."""

from models.tasks.train_image_classifier import run

if __name__ == "__main__":
    run()
