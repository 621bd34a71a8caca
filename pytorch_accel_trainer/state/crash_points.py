"""The named points between the steps of a save, where a test simulates a crash.

The writers of training states (``folder``, ``parts``, ``storage``) call :func:`crash_point` between
their steps. It does nothing; a test replaces it (``monkeypatch.setattr(crash_points, "crash_point", crash)``) to
stop a save at one point and check what a crash there leaves. A leaf: it imports nothing of the package.
"""


def crash_point(name: str) -> None:
    """Called between the steps of a save with the step's name (``"manifest"``, ``"write:optimizer.pt"``,
    ``"upload:model.safetensors"``, ...); does nothing."""
