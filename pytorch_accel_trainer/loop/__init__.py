"""The parts of a training step that the Trainer composes, each with its own state and a narrow interface: the run's
state and its transitions (``run_state``), the accumulation window (``accumulation``), batches and their weights
(``batches``), the non-finite gradient policy (``non_finite``), the epoch's recorded values and the run's result
(``recording``), the learning-rate range test's sweep, suggestion and snapshot (``lr_find``), the trainer's parts of
a training state and how a resume puts them back (``trainer_parts``), the time budget (``time_budget``), where a run
writes, checked before its first batch (``destinations``); and the Trainer's two feature mixins, saving and loading
(``persistence``, which hands the states to ``state.manager.TrainingStates``) and extra models trained beside the main
one (``extra_models``), which call none of the Trainer's private methods.

Imports the layers below it (``state``, ``parallel``, the public leaf modules and ``callbacks.base``'s protocol); no
concrete callback: a callback says what it writes through ``TrainerCallback.writes_to``. Only ``trainer.py`` and
``cli`` import it.
"""
