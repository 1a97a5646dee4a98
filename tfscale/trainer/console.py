"""The lines the Trainer says to a person, and where they go.

Where absl's log shows INFO lines (under absl's `app.run`: the entry
points, `run_pretraining.py` and the others, whose logs the launchers
collect per worker) they go there, as before. Elsewhere (a plain Python
script, a notebook: absl's level is WARNING) they go to stdout, as Keras's
`fit` prints: the interval lines (`verbose=2`), where a fit resumes, each
checkpoint saved, a preemption. Nothing here lowers absl's level, so
TensorFlow's own INFO messages stay hidden.
"""

from absl import logging


def say(message: str) -> None:
    """One line: `tfscale: <message>`."""
    if logging.level_info():
        logging.info("tfscale: %s", message)
    else:
        print(f"tfscale: {message}", flush=True)
