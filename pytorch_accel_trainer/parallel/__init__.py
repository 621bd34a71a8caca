"""Several processes and devices: how a launch becomes an Accelerator and how processes agree on a decision
(``distributed``), and what FSDP and DeepSpeed need done differently (``sharded``).

Imports only the leaf modules (``errors``, ``utils``), torch and Accelerate.
"""
