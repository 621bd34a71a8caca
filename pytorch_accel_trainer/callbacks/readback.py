"""Bring a few numbers from the device to the host without making the host wait for the device."""

from __future__ import annotations

from typing import Any, Optional

import torch

from pytorch_accel_trainer.tracking import DeferredSum


class RunningSum(DeferredSum):
    """A sum of scalar tensors added up on their device, in place: no host-device sync, and nothing of a value kept
    (see :class:`~pytorch_accel_trainer.tracking.DeferredSum`)."""

    @property
    def count(self) -> int:
        """The number of values added since the last reset."""
        return self.weight_total


class HostCopy:
    """Copies a small float tensor to the host asynchronously, and tells when the copy has arrived.

    On CUDA, the copy goes to pinned host memory without blocking, and a CUDA event marks its end, so
    reading it never waits for the device: :meth:`get_values` returns ``None`` until the device has
    caught up. On the CPU the copy is complete at once. Other devices copy synchronously (one wait per
    call of :meth:`start`).

    Args:
        numel: the most values copied at once (the buffer's size); a copy may hold fewer.
        device: the device the values come from.
    """

    def __init__(self, numel: int, device: torch.device):
        self.numel = numel
        self._device = device
        self._is_cuda = device.type == "cuda"
        self._host = torch.zeros(numel, dtype=torch.float32, pin_memory=self._is_cuda)
        # A numpy view of the same memory, read with numpy: the values are already on the host then.
        self._host_values = self._host.numpy()
        self._ready: Optional[Any] = None
        self._tag: Any = None
        self._count = 0
        self._pending = False

    def start(self, values: torch.Tensor, tag: Any = None) -> None:
        """Start copying ``values`` (flattened: at most ``numel`` floats); ``tag`` comes back with them."""
        flat = values.detach().reshape(-1)
        if flat.numel() > self.numel:
            raise ValueError(f"HostCopy holds {self.numel} values, not {flat.numel()}: make one of that size.")
        self._count = flat.numel()
        self._host[: self._count].copy_(flat, non_blocking=self._is_cuda)
        if self._is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self._device))
        self._tag, self._pending = tag, True

    def get_values(self, wait: bool = False) -> Optional[tuple[Any, list]]:
        """Return ``(tag, values)`` of the last copy once it has arrived, once; else ``None``.

        Args:
            wait: wait for the copy to arrive (a host-device sync on CUDA), e.g. at the end of an epoch.
        """
        if not self._pending:
            return None
        if self._ready is not None and not self._ready.query():
            if not wait:
                return None  # the device has not reached the copy yet; try again later
            self._ready.synchronize()
        self._pending = False
        return self._tag, self._host_values[: self._count].tolist()
