"""The parts of a training step that the Trainer composes, each with its own state and a narrow interface: the run's
state, its transitions and the accumulation window's state (``run_state``), what is done to the gradients before an
update (``accumulation``), batches and their weights (``batches``), the non-finite gradient policy (``non_finite``),
the epoch's recorded values and the run's result (``recording``), the learning-rate range test's sweep, suggestion
and snapshot (``lr_find``), the checks of the model, loss function, optimizer and constructor options
(``components``), the check of the first evaluation batch (``first_eval_batch``), each module's train/eval mode kept
across a pass (``training_modes``), the trainer's parts of a training state and how a resume puts them back
(``trainer_parts``), the time budget (``time_budget``), where a run writes, checked before its first batch
(``destinations``), resume and the saves and preemption at each point between two updates (``safe_points``, which
hands the states to ``state.manager.TrainingStates``); and the Trainer's two feature mixins, saving and loading
(``persistence``) and extra models trained beside the main one (``extra_models``), which call none of the Trainer's
private methods.

Imports the layers below it (``state``, ``parallel`` and the public leaf modules), never a callback: what the loop
needs of the callbacks it asks through the protocol of ``TrainerCallback`` (a method with a default: ``writes_to``,
``watched_metric``), every callback alike. Only ``trainer.py`` and ``cli`` import it.
"""
