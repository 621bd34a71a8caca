"""Several processes and devices: the processes a launch started and running a function on one of them first
(``processes``, whose decorators ``utils`` makes public), how a launch becomes an Accelerator and how processes agree
on a decision (``distributed``), and what FSDP and DeepSpeed need done differently (``sharded``).

Imports only the leaf module ``errors``, torch and Accelerate.
"""
