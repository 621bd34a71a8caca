"""Training states and export checkpoints on disk: the files and their manifest and checksums (``files``), the
crash-safe folder writer and reader (``training_state``), background saves (``async_save``), portable export
checkpoints (``checkpointing``), random-generator states (``rng``) and preemption signals (``preemption``).

Knows nothing of the Trainer: it reads and writes what it is given. Imports only ``parallel`` and the leaves.
"""
