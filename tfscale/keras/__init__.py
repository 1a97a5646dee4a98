"""Keras's side: `model.fit` on many workers, and Keras's callbacks.

    multi_worker_fit.py  `enable_multi_worker_fit()`: fit under MWMS, correct
    fit_preemption.py    fit's workers agree on stopping and on a
                         preemption (the backup mid-epoch, exit 143), and
                         resume mid-epoch
    fit_arguments.py     what `model.fit` takes -> a `dataset_fn`
    callbacks.py         version workarounds for Keras's callbacks
    callback_files.py    chief-only files for Keras's file-writing callbacks

It imports the cluster layer and the base modules, not the Trainer.
"""
