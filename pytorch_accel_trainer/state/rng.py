"""The random number generators of a process, as plain tensors and numbers (no pickle needed to read them back).
A leaf: it imports nothing of the package."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def capture_rng_state() -> dict:
    """Return the state of every RNG of this process: torch, CUDA, numpy and ``random``."""
    numpy_state = cast(tuple, np.random.get_state(legacy=True))  # the legacy form: a tuple
    python_version, python_internal, python_gauss = random.getstate()
    state = {
        "torch": torch.random.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "position": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "python": {"version": python_version, "internal": list(python_internal), "gauss": python_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what :func:`capture_rng_state` returned."""
    torch.random.set_rng_state(state["torch"])
    np.random.set_state(_numpy_state(state))
    random.setstate(_python_state(state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def validate_rng_state(state: Any) -> None:
    """Check that ``state`` (as :func:`capture_rng_state` returns, read from a file) can be restored, by loading it
    into throwaway generators: the process's own are untouched.

    Raises:
        ValueError: what is wrong (a key missing, a state of the wrong size or type), in the generator's words.
    """
    try:
        torch.Generator().set_state(state["torch"])
        np.random.RandomState().set_state(_numpy_state(state))
        random.Random().setstate(_python_state(state))
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or any(
            not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8 for generator in cuda
        ):
            raise TypeError("the CUDA generators' states are not a list of uint8 tensors")
    except (LookupError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as error:
        problem = f"{type(error).__name__}: {error}"
        raise ValueError(f"its random generators' states cannot be restored ({problem})") from None


def _numpy_state(state: dict) -> tuple:
    numpy_state = state["numpy"]
    return (
        "MT19937",
        numpy_state["keys"].numpy().astype(np.uint32),
        numpy_state["position"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    )


def _python_state(state: dict) -> tuple:
    python_state = state["python"]
    return (python_state["version"], tuple(python_state["internal"]), python_state["gauss"])
