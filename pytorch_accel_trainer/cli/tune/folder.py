"""The search's folder: the files it holds, the check that a folder belongs to this search, and the files a call
created (removed again when the first trial shows that the search cannot run)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from pytorch_accel_trainer.cli.config import ConfigError
from pytorch_accel_trainer.cli.run_folder import remove_if_empty

#: The files of a search's folder: the config every trial starts from, the default study, the best trial's config.
BASE_CONFIG_FILE, STUDY_FILE, BEST_CONFIG_FILE, TRIALS_FOLDER = (
    "base_config.yaml",
    "study.db",
    "best_config.yaml",
    "trials",
)


def validate_folder_of_this_search(output_dir: Path, config_text: str) -> None:
    """Refuse a search's folder whose ``base_config.yaml`` is another config: a resumed search must start from the
    same (a search is one experiment)."""
    path = output_dir / BASE_CONFIG_FILE
    if path.exists() and yaml.safe_load(path.read_text()) != yaml.safe_load(config_text):
        raise ConfigError(
            f"{path} holds another config than this search's: this folder belongs to another search. Give "
            "another --output_dir, or rerun with the config of that search to resume it."
        )


def write_base_config(output_dir: Path, config_text: str) -> None:
    """Write the config every trial starts from, unless a resumed search wrote it (then it is the same: see
    :func:`validate_folder_of_this_search`)."""
    base_config = output_dir / BASE_CONFIG_FILE
    if not base_config.exists():
        output_dir.mkdir(parents=True, exist_ok=True)
        base_config.write_text(config_text)


def paths_to_create(output_dir: Path, storage: Optional[str]) -> tuple:
    """The paths of the search's folder that do not exist yet, each folder before what it holds: what this call
    creates (the study file only with the default storage)."""
    files = (output_dir, *([output_dir / STUDY_FILE] if storage is None else []), output_dir / BASE_CONFIG_FILE)
    return tuple(path for path in (*files, output_dir / TRIALS_FOLDER) if not path.exists())


def remove_created(created: tuple) -> None:
    """Remove what :func:`paths_to_create` listed: the files, then the folders that held them (if empty)."""
    for path in reversed(created):
        if path.is_dir():
            remove_if_empty(path)
        elif path.exists():
            path.unlink()
