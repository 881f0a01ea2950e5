"""Which installed distribution a module comes from, for ``tileops ops`` and ``tileops backends``.

``importlib.metadata.packages_distributions()`` answers by top-level package, which settles
most modules but not all of TileOPs' own: ``tileops`` is a namespace package that several
distributions share, and editable installs (a workspace checkout) record no top-level names.
There the module's file is matched against the files each distribution installed, or against
the source folders an editable install puts on ``sys.path`` through its ``.pth`` file.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from pathlib import Path


@functools.cache
def _top_level_owners() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(module_name: str) -> str | None:
    """The distribution that installed the (imported) module ``module_name``, or None."""
    owners = set(_top_level_owners().get(module_name.partition(".")[0], ()))
    if len(owners) == 1:
        return owners.pop()
    path = getattr(sys.modules.get(module_name), "__file__", None)
    if path is None:
        return None
    return _owner_of_file(Path(path).resolve())


def _owner_of_file(path: Path) -> str | None:
    files, source_folders = _installed_paths()
    owner = files.get(path)
    if owner is not None:
        return owner
    # The deepest folder wins, in case one editable install's folder holds another's.
    holding = [(len(folder.parts), name) for folder, name in source_folders if path.is_relative_to(folder)]
    return max(holding)[1] if holding else None


@functools.cache
def _installed_paths() -> tuple[dict[Path, str], list[tuple[Path, str]]]:
    """Every installed Python file with its distribution, and every folder an editable
    install adds to ``sys.path`` with its distribution."""
    files: dict[Path, str] = {}
    source_folders: list[tuple[Path, str]] = []
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"]
        # Resolving the install folder once, not every file, keeps this fast; records are
        # plain relative paths below it.
        base = Path(distribution.locate_file("")).resolve()
        for record in distribution.files or ():
            if record.suffix == ".py":
                files[Path(os.path.normpath(base / record))] = name
            elif record.suffix == ".pth":
                source_folders.extend((folder, name) for folder in _pth_folders(base / record))
    return files, source_folders


def _pth_folders(pth: Path) -> list[Path]:
    """The folders a ``.pth`` file adds to ``sys.path`` (its other lines run code; skipped)."""
    try:
        lines = pth.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "import ", "import\t")):
            continue
        folder = (pth.parent / line).resolve()
        if folder.is_dir():
            folders.append(folder)
    return folders
