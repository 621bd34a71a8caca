"""Callbacks: the base protocol and the ready-made callbacks, one family per module."""

from pytorch_accel_trainer.callbacks.base import (
    EVENTS,
    CallbackHandler,
    CallbackMethodNotImplementedError,
    TrainerCallback,
)
from pytorch_accel_trainer.callbacks.base import logger as logger  # as in pytorch-accelerated; not in __all__
from pytorch_accel_trainer.callbacks.checkpoints import SaveBestModelCallback
from pytorch_accel_trainer.callbacks.control import (
    LimitBatchesCallback,
    NonFiniteLossError,
    TerminateOnNaNCallback,
    with_limit_batches_from_env,
)
from pytorch_accel_trainer.callbacks.defaults import get_default_callbacks
from pytorch_accel_trainer.callbacks.device import ConvertSyncBatchNormCallback, MoveModulesToDeviceCallback
from pytorch_accel_trainer.callbacks.early_stopping import EarlyStoppingCallback
from pytorch_accel_trainer.callbacks.ema import ModelEmaCallback
from pytorch_accel_trainer.callbacks.evaluation import (
    LimitEvalStepsCallback,
    StepBasedEvaluationCallback,
    is_intermediate_evaluation,
)
from pytorch_accel_trainer.callbacks.finetuning import GradualUnfreezingCallback
from pytorch_accel_trainer.callbacks.memory import PeakMemoryCallback
from pytorch_accel_trainer.callbacks.metrics import MetricCollectionCallback
from pytorch_accel_trainer.callbacks.monitor import MonitorCallback
from pytorch_accel_trainer.callbacks.non_finite import (  # noqa: F401  (importable here; docs/api lists __all__)
    NonFiniteGradientsError,
    SkipNonFiniteStepsCallback,
)
from pytorch_accel_trainer.callbacks.progress import (
    LogMetricsCallback,
    PrintMetricsCallback,
    PrintProgressCallback,
    ProgressBarCallback,
)
from pytorch_accel_trainer.callbacks.trackers import CSVTracker, ExperimentTrackingCallback, JSONLinesTracker
from pytorch_accel_trainer.callbacks.training_state import SaveTrainingStateCallback
from pytorch_accel_trainer.callbacks.wsd import WSDCheckpointCallback
from pytorch_accel_trainer.errors import StopTrainingError
from pytorch_accel_trainer.state.storage import CHECKPOINTS, TRAINING_STATES, Destination
from pytorch_accel_trainer.utils import (  # importable from here, as in pytorch-accelerated
    LIMIT_BATCHES_ENV_VAR,
    DataLoaderSlice,
    ModelEma,
)

__all__ = [
    "CHECKPOINTS",
    "Destination",
    "TRAINING_STATES",
    "EVENTS",
    "LIMIT_BATCHES_ENV_VAR",
    "CSVTracker",
    "CallbackHandler",
    "CallbackMethodNotImplementedError",
    "ConvertSyncBatchNormCallback",
    "DataLoaderSlice",
    "EarlyStoppingCallback",
    "ExperimentTrackingCallback",
    "GradualUnfreezingCallback",
    "JSONLinesTracker",
    "LimitBatchesCallback",
    "LimitEvalStepsCallback",
    "LogMetricsCallback",
    "MetricCollectionCallback",
    "ModelEma",
    "ModelEmaCallback",
    "MonitorCallback",
    "MoveModulesToDeviceCallback",
    "NonFiniteGradientsError",
    "NonFiniteLossError",
    "PeakMemoryCallback",
    "PrintMetricsCallback",
    "PrintProgressCallback",
    "ProgressBarCallback",
    "SaveBestModelCallback",
    "SaveTrainingStateCallback",
    "SkipNonFiniteStepsCallback",
    "StepBasedEvaluationCallback",
    "StopTrainingError",
    "TerminateOnNaNCallback",
    "TrainerCallback",
    "WSDCheckpointCallback",
    "get_default_callbacks",
    "is_intermediate_evaluation",
    "with_limit_batches_from_env",
]
