"""Hatch build hook that ships the repository's top-level ``manifest/`` inside tileops-ops.

In the source tree the manifest sits two folders above this project; in an unpacked sdist
it sits beside this file (the sdist hook put it there). Wheels carry it as
``tileops/ops/manifest`` so that ``importlib.resources`` finds it next to the op classes.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ManifestHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def _manifest_dir(self) -> Path:
        root = Path(self.root)
        for candidate in (root.parent.parent / "manifest", root / "manifest"):
            if candidate.is_dir() and any(candidate.glob("*.yaml")):
                return candidate
        raise FileNotFoundError(
            f"tileops-ops build: no manifest/ with *.yaml files found above or inside {root}"
        )

    def initialize(self, version: str, build_data: dict) -> None:
        manifest = self._manifest_dir()
        if self.target_name == "sdist":
            build_data["force_include"][str(manifest)] = "manifest"
        elif version != "editable":
            # An editable install reads src/tileops/ops/manifest, a link to the same folder.
            build_data["force_include"][str(manifest)] = "tileops/ops/manifest"
