"""Reading a manifest file's YAML as plain data, and nothing else: no anchors or aliases (a few
kilobytes of them expand to gigabytes), no merge keys, scalar keys given once per mapping (YAML
would keep the last silently), at most ``MAX_DEPTH`` levels of nesting."""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import ManifestError
from .quoting import shown, shown_text

#: How deeply the YAML may nest mappings and lists; entries need six levels.
MAX_DEPTH = 32


def read_yaml(text: str, source: str) -> Any:
    """The document of ``text``; a ``ManifestError`` naming ``source`` where it is not plain YAML."""
    try:
        return yaml.load(text, Loader=_ManifestLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ManifestError(f"{source}: not valid YAML: {shown_text(str(error), 600)}") from None


class _ManifestLoader(yaml.SafeLoader):
    """Safe loading of plain data: no anchors or aliases, no merge keys, keys that are scalars
    and given once per mapping (YAML would keep the last), at most MAX_DEPTH levels."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None,
                f"uses the anchor or alias {shown_text(event.anchor)!r}; manifests do not use anchors and aliases "
                "(a small file of them expands without bound): write each value out",
                event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nests mappings and lists more than {MAX_DEPTH} levels deep", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _ManifestLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            raise yaml.constructor.ConstructorError(
                None, None, "uses a merge key ('<<'), which manifests do not: write the fields out", key_node.start_mark
            )
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, f"has a {key_node.id} as a mapping key; keys are names", key_node.start_mark
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_ManifestLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
