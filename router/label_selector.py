"""Kubernetes label selectors, as `kubectl get -l` takes them: parsed once, matched against a pod's labels.

```
selector = LabelSelector.parse("app=vllm,tier in (gpu, big),!canary")
selector.matches({"app": "vllm", "tier": "gpu"})  # True
str(selector)  # what the API server's labelSelector parameter takes
```

The API server filters by the same selector; matching here too keeps a server that does not (or an
InferencePool's selector changed under a running watch) from handing over pods that are not asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Operator = Literal["=", "!=", "in", "notin", "exists", "!"]

_NAME = r"[a-z0-9A-Z](?:[-a-z0-9A-Z_.]{0,61}[a-z0-9A-Z])?"
_KEY = rf"(?:[a-z0-9A-Z](?:[-a-z0-9A-Z_.]{{0,251}}[a-z0-9A-Z])?/)?{_NAME}"  # [prefix/]name
_VALUE = rf"(?:{_NAME})?"
_REQUIREMENT = re.compile(
    rf"""\s*(?:
        (?P<absent>!)\s*(?P<absent_key>{_KEY})
      | (?P<set_key>{_KEY})\s+(?P<set_op>in|notin)\s*\((?P<values>[^)]*)\)
      | (?P<eq_key>{_KEY})\s*(?P<eq_op>==|!=|=)\s*(?P<eq_value>{_VALUE})
      | (?P<key>{_KEY})
    )\s*(?:,|$)""",
    re.VERBOSE,
)
_VALUE_ONLY = re.compile(rf"^{_VALUE}$")
LABEL_KEY = re.compile(rf"^{_KEY}$")


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.operator:
            case "=" | "in":
                return value in self.values
            case "!=" | "notin":
                return value not in self.values
            case "exists":
                return value is not None
            case "!":
                return value is None

    def __str__(self) -> str:
        if self.operator in ("=", "!="):
            return f"{self.key}{self.operator}{next(iter(self.values))}"
        if self.operator in ("in", "notin"):
            return f"{self.key} {self.operator} ({','.join(sorted(self.values))})"
        return self.key if self.operator == "exists" else f"!{self.key}"


@dataclass(frozen=True, slots=True)
class LabelSelector:
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """ValueError naming what does not parse; an empty selector matches everything, as the API's."""
        requirements: list[Requirement] = []
        position = 0
        text = text.strip()
        while position < len(text):
            match = _REQUIREMENT.match(text, position)
            if match is None or match.end() == position:
                raise ValueError(f"{text!r} is not a label selector (at {text[position:]!r})")
            requirements.append(_requirement(match))
            position = match.end()
        return cls(tuple(requirements))

    @classmethod
    def of_labels(cls, labels: Mapping[str, str]) -> LabelSelector:
        """The selector of a matchLabels map (an InferencePool's spec.selector)."""
        for key, value in labels.items():
            if not LABEL_KEY.match(key) or not _VALUE_ONLY.match(value):
                raise ValueError(f"{key}={value} is not a label")
        return cls(tuple(Requirement(k, "=", frozenset({v})) for k, v in sorted(labels.items())))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)

    def __str__(self) -> str:
        return ",".join(str(requirement) for requirement in self.requirements)


def _requirement(match: re.Match[str]) -> Requirement:
    if match["absent"]:
        return Requirement(match["absent_key"], "!")
    if match["set_key"]:
        values = [value.strip() for value in match["values"].split(",")]
        if not all(_VALUE_ONLY.match(value) for value in values):
            raise ValueError(f"{match['values']!r} is not a list of label values")
        return Requirement(match["set_key"], match["set_op"], frozenset(values))  # type: ignore[arg-type]
    if match["eq_key"]:
        operator: Operator = "!=" if match["eq_op"] == "!=" else "="
        return Requirement(match["eq_key"], operator, frozenset({match["eq_value"]}))
    return Requirement(match["key"], "exists")
