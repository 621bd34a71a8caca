# Copyright © 2021 Chris Hughes
# Vendored from pytorch-accelerated 0.1.61, docs/callbacks.rst (the literal block at line 184), under the Apache License 2.0
# (https://www.apache.org/licenses/LICENSE-2.0). tests/test_peer_docs.py runs it after the names the snippet takes
# as given (tests/peer_docs/prelude.py). Changed here, nothing else: `pytorch_accelerated` is renamed to
# `pytorch_accel_trainer`, and trailing whitespace is dropped.
# fmt: off
# ruff: noqa
from collections import defaultdict
import pandas as pd

class SavePredictionsCallback(TrainerCallback):

    def __init__(self, out_filename='./outputs/valid_predictions.csv') -> None:
        super().__init__()
        self.predictions = defaultdict(list)
        self.out_filename = out_filename

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        input_features, targets = batch
        class_preds = trainer.gather(batch_output['model_outputs']).argmax(dim=-1)
        self.predictions['prediction'].extend(class_preds.cpu().tolist())
        self.predictions['targets'].extend(targets.cpu().tolist())

    def on_eval_epoch_end(self, trainer, **kwargs):
        trainer._accelerator.wait_for_everyone()
        if trainer.run_config.is_local_process_zero:
            df = pd.DataFrame.from_dict(self.predictions)
            df.to_csv(f'{self.out_filename}', index=False)
