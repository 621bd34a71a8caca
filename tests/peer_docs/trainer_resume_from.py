# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, docs/trainer.rst (the literal block at line 141), under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_docs.py runs it after the names the snippet takes
# as given (tests/peer_docs/prelude.py). Changed here, nothing else: `pytorch_accelerated` is renamed to
# `pytorch_accel_trainer`, and trailing whitespace is dropped.
# fmt: off
# ruff: noqa
# Save during training (e.g. via SaveTrainingStateCallback)
trainer.save_training_state("checkpoints/step_5000")

# Resume later
trainer.train(
    train_dataset=dataset,
    num_epochs=10,
    resume_from="checkpoints/step_5000",
)
