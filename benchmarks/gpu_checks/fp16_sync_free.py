"""On a CUDA GPU: training with the default callbacks, every ordinary step under
``torch.cuda.set_sync_debug_mode("error")`` (any host-device synchronisation in a step raises).

This is the ``sync_free_<precision>`` check of ``run.py`` (which runs it for no, bf16 and fp16, each in a fresh
process); this entry point runs it for one precision:

    python benchmarks/gpu_checks/fp16_sync_free.py [fp16|bf16|no]

Prints the outcome (on a failure, every site that synchronised) and exits non-zero if the check fails; on a
machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys

from checks import check_sync_free


def main(precision: str) -> int:
    result = check_sync_free(precision, smoke=False)
    print(f"{precision}: {result['status']}: {result['summary']}")
    return 1 if result["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "fp16"))
