"""Time to accuracy: what each global batch costs in steps and examples.

    python -m benchmarks.time_to_accuracy --task fashion_mnist   # sweep.py

- `sweep.py`: the sweep over batches and learning rates, and its command
- `study.py`: what a study is (its definition and digest) and one run of it
- `tasks.py`: Fashion-MNIST, scikit-learn's digits, BERT-tiny's masked LM
- `analysis.py`: the results file, the best rate per batch, the fit, the
  tables and plot
- `behaviour.py`: the engine's numbers a study rests on, as golden vectors
"""
