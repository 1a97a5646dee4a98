"""ResNet-50 on ImageNet-format records, from a checkout: `python train_image_classifier.py --flags`
(Google's and NVIDIA's command lines work unchanged). The code and its
flags: `models/tasks/train_image_classifier.py`; installed, the console script is
`tfscale-train-images`."""

from models.tasks.train_image_classifier import run

if __name__ == "__main__":
    run()
