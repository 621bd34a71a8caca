"""``python -m pytorch_accel_trainer fit --config run.yaml``: the command line of ``cli.py``."""

from pytorch_accel_trainer.cli import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
