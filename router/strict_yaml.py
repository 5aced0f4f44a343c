"""YAML as the configuration reads it: a key given twice in one mapping is an error, not the last one winning
(a second `traffic:` block would silently drop the first one's split)."""

from __future__ import annotations

from typing import Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKey(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *defaults`: its keys may be overridden, as YAML intends
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise DuplicateKey(f"the key {key!r} is given twice in one mapping (line {mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain data only
