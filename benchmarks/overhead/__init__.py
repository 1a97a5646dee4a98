"""What the engine costs around the model: the Trainer against a minimal
loop and model.fit, measuring the noise scale, watching a run.

- `trainer.py`: tfscale.Trainer against a minimal strategy.run loop
- `fit_comparison.py`: the Trainer against model.fit on 2 workers
- `fit_worker.py`: one worker of fit_comparison.py
- `noise_scale.py`: what measuring the gradient noise scale costs
- `watch_cost.py`: a heartbeat and the chief's gather, against the step
"""
