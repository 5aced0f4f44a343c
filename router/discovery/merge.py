"""The configuration the router runs: the file's, with the instances discovery found beside its own."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError

from router.config import ConfigError, InstanceConfig, RouterConfig, format_errors

log = logging.getLogger(__name__)


def with_discovered(config: RouterConfig, discovered: Sequence[InstanceConfig]) -> RouterConfig:
    """config with discovered beside its instances, checked as a file's are. A discovered instance with the
    name, URL or events endpoint of one of the file's is left out, logged: the file says what it means.
    ConfigError when the whole does not validate."""
    if not discovered:
        return config
    static = config.instances
    taken = {key for i in static for key in (i.name, i.url, i.events, i.replay) if key is not None}
    kept = []
    for instance in discovered:
        clash = {instance.name, instance.url, instance.events, instance.replay} & taken
        if clash:
            log.warning("discovered %s left out: %s is the configuration's own", instance.name, clash.pop())
            continue
        kept.append(instance)
    fields = {name: getattr(config, name) for name in type(config).model_fields}
    try:
        return RouterConfig.model_validate(fields | {"instances": [*static, *kept]})
    except ValidationError as exc:
        problems = format_errors(exc, RouterConfig)
        raise ConfigError(f"discovery: the instances found do not fit\n{problems}") from exc
