"""Training states and export checkpoints on disk: the files and their manifest and checksums (``files``), the
crash-safe folder writer and reader (``training_state``), background saves (``async_save``), object storage
(``storage``), portable export checkpoints (``checkpointing``), random-generator states (``rng``), preemption signals
(``preemption``) and the points between a save's steps where tests simulate a crash (``crash_points``).

Knows nothing of the Trainer: it reads and writes what it is given. Imports only ``parallel`` and the leaves.
"""
