"""torch alone, no trainer: a 2-process gloo script whose last line is a collective (an ``all_gather``, as FSDP2's
last all-gather of parameters or the trainer's last ``gather_object``), with no teardown. A gloo worker thread
releases the collective's work object, and with it the last C++ reference to Python tensors, after the main thread
has returned from it; if the main thread is finalising Python by then, the worker's GIL request ends it inside a
``noexcept`` destructor: "terminate called without an active exception" (SIGABRT). ``stress.py --slow-gloo`` widens
that window (pytorch/pytorch#190489: ``decref`` guards on ``Py_IsInitialized()``, which holds during finalisation).

    .venv/bin/python benchmarks/exit_stress/stress.py --launcher torchrun --slow-gloo --launches 5 \\
        --script benchmarks/exit_stress/torch_only.py
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
gathered = [torch.empty(4) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.arange(4.0) + dist.get_rank())
