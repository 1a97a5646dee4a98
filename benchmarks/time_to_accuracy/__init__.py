"""Time to accuracy: what each global batch costs in steps and examples.

    python -m benchmarks.time_to_accuracy --task fashion_mnist   # study.py

- `study.py`: the study
- `behaviour.py`: the engine's numbers a study rests on, as golden vectors
"""
