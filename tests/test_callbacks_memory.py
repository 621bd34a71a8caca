"""PeakMemoryCallback on a tiny real run (on the CPU here: the peak host memory)."""

from __future__ import annotations

from conftest import linear_dataset, make_linear, make_trainer

from pytorch_accel_trainer.callbacks import LogMetricsCallback, PeakMemoryCallback
from pytorch_accel_trainer.callbacks.memory import HOST_MEMORY_METRIC, get_peak_host_memory_mib


def test_records_peak_host_memory(capsys):
    """Records the peak host memory of each epoch where there is no CUDA."""
    trainer = make_trainer(make_linear(), callbacks=[PeakMemoryCallback, LogMetricsCallback])
    trainer.train(linear_dataset(16), num_epochs=3, per_device_batch_size=4)
    peaks = trainer.run_history.get_metric_values(HOST_MEMORY_METRIC)
    assert len(peaks) == 3 and peaks == sorted(peaks)  # the peak of the process so far only grows
    assert (
        50 < peaks[0] <= get_peak_host_memory_mib() < 24 * 1024
    )  # a Python process with torch, under the machine's size
    assert capsys.readouterr().out.count(f"{HOST_MEMORY_METRIC}: ") == 3  # recorded before the metrics are logged
