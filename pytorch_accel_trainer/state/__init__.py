"""Training states and export checkpoints on disk.

One owner for a run's training states, :class:`~pytorch_accel_trainer.state.manager.TrainingStates` (``manager``): it
saves, finds (which state a resume continues) and prunes them, given the processes and the ``Stateful`` parts to save.
Behind it, by responsibility: one state's folder, written crash-safely, verified by its manifest and pruned
(``folder``); what a state holds as its owners hand it over, and how each process writes and reads its part, in one file
for one process (``parts``), else the tensors one shard per process through ``torch.distributed.checkpoint``
(``shards``, imported only then); the files, their names, manifest schema,
checksums, durable writes and the points between a save's steps where tests simulate a crash (``files``); background
saves (``async_save``); object storage (``storage``); a sharded state made whole on one machine (``consolidate``).
``training_state`` is the public import path of the lookup and the state's types. Beside them: the one-file export
checkpoints of ``save_checkpoint`` (``checkpointing``) and preemption signals (``preemption``). The trainer's own parts
(its RNG states among them) are handed over by ``loop/trainer_parts.py``.

Knows nothing of the Trainer: it is given what it saves (objects with ``state_dict()`` / ``load_state_dict()`` and
plain values) and the processes that save it together. Imports only ``parallel`` and the leaves.
"""
