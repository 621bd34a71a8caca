"""The parts of a training step that the Trainer composes: the run's state (``run_state``), the accumulation
window (``accumulation``), batches and their weights (``batches``), the non-finite gradient policy
(``non_finite``), extra models trained beside the main one (``extra_models``), and the Trainer's preparation,
persistence and loop helpers.

Imports the layers below it (``state``, ``parallel``, ``callbacks`` and the public leaf modules); only
``trainer.py`` and ``cli`` import it.
"""
