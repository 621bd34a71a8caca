"""Training states and export checkpoints on disk: what a state holds as its owners hand it over, and how each process
writes and reads its part (``content``), the tensors one shard per process through ``torch.distributed.checkpoint``
(``distcp``), the files and their manifest and checksums (``files``), the crash-safe folder writer and reader
(``training_state``), which state a resume continues (``lookup``), background saves (``async_save``), object storage
(``storage``), a sharded state made whole on one machine (``consolidate``), portable export checkpoints
(``checkpointing``), random-generator states (``rng``), preemption signals (``preemption``) and the points between a
save's steps where tests simulate a crash (``crash_points``).

Knows nothing of the Trainer: it is given what it saves (objects with ``state_dict()`` / ``load_state_dict()`` and
plain values) and the processes that save it together. Imports only ``parallel`` and the leaves.
"""
