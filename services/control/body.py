"""A run config from a request body (JSON or YAML), parsed within limits on nesting depth, YAML
aliases and the size of the value once its aliases are expanded.

A few hundred bytes of YAML can name a billion values through nested aliases ("billion laughs"),
and a few kilobytes can nest deeper than Python's recursion limit; either would hold a worker
(and its memory) long after the request. The limits refuse both while the body is parsed, in
time linear in the body, before any value is built from it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from services.common.config import ConfigError

__all__ = ["YAML_TYPES", "BodyLimits", "ConfigLimitExceeded", "parse_body"]

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class ConfigLimitExceeded(ConfigError):
    """A body beyond one of :class:`BodyLimits` (HTTP 422; the message names the setting)."""


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    """Limits of a submitted config (settings ``XTOKEN_CONTROL_MAX_CONFIG_*``).

    Attributes:
        depth: most levels of nested mappings and lists.
        aliases: most YAML aliases (``*name``) in one body.
        nodes: most values (mappings, lists, scalars) with every alias expanded.
    """

    depth: int = 32
    aliases: int = 64
    nodes: int = 100_000


def _too_deep(limits: BodyLimits) -> ConfigLimitExceeded:
    return ConfigLimitExceeded(
        f"the config nests deeper than {limits.depth} levels "
        "(XTOKEN_CONTROL_MAX_CONFIG_DEPTH); a run config needs a few"
    )


def _too_big(limits: BodyLimits) -> ConfigLimitExceeded:
    return ConfigLimitExceeded(
        f"the config holds more than {limits.nodes} values once its aliases are expanded "
        "(XTOKEN_CONTROL_MAX_CONFIG_NODES); send a smaller config"
    )


def parse_body(body: bytes, content_type: str, limits: BodyLimits | None = None) -> Any:
    """A run config from a request body: JSON or YAML (by content type; otherwise JSON, then
    YAML), within ``limits``.

    Args:
        body: the request body.
        content_type: its ``Content-Type`` header.
        limits: the limits (default :class:`BodyLimits`).

    Returns:
        The parsed value (a mapping for a run config; the caller checks).

    Raises:
        ConfigLimitExceeded: deeper, more aliases or more values than ``limits`` (names the
            setting).
        ConfigError: the body is empty, not UTF-8, or does not parse (names the line).
    """
    limits = limits or BodyLimits()
    if not body.strip():
        raise ConfigError("the request body is empty; send a run config as JSON or YAML")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("the request body is not UTF-8 text; send JSON or YAML") from None
    ctype = content_type.split(";")[0].strip().lower()
    if ctype not in YAML_TYPES:
        try:
            value = json.loads(text)
        except RecursionError:
            raise _too_deep(limits) from None
        except json.JSONDecodeError as e:
            if ctype == "application/json":
                raise ConfigError(
                    f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                ) from None
        else:
            _check_value(value, limits)
            return value
    return _load_yaml(text, limits)


def _check_value(value: Any, limits: BodyLimits) -> None:
    """Depth and size of a parsed JSON value (JSON has no aliases: each value is its own)."""
    stack = [(value, 1)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limits.nodes:
            raise _too_big(limits)
        if isinstance(node, dict | list):
            if depth > limits.depth:
                raise _too_deep(limits)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)


def _loader_class(limits: BodyLimits) -> Any:
    import yaml

    from services.common import config as cfgmod

    base = cfgmod.yaml_loader()  # reads 1e-4 as a float, like `xtoken run` does

    class LimitedLoader(base):  # type: ignore[misc, valid-type]
        """The config loader, counting nesting depth and aliases while it composes nodes."""

        _depth = 0
        _aliases = 0

        # the scanner's cost per token grows with the open flow collections and indents: the
        # depth is refused as the scanner reaches it, before the composer sees a node
        def fetch_flow_collection_start(self, token_class: Any) -> None:
            if self.flow_level >= limits.depth:
                raise _too_deep(limits)
            super().fetch_flow_collection_start(token_class)

        def add_indent(self, column: int) -> bool:
            if len(self.indents) >= limits.depth:
                raise _too_deep(limits)
            return super().add_indent(column)

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > limits.aliases:
                    raise ConfigLimitExceeded(
                        f"the config uses more than {limits.aliases} YAML aliases "
                        "(XTOKEN_CONTROL_MAX_CONFIG_ALIASES); write the values out"
                    )
            self._depth += 1
            try:
                if self._depth > limits.depth:
                    raise _too_deep(limits)
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return LimitedLoader


def _load_yaml(text: str, limits: BodyLimits) -> Any:
    import yaml

    loader = _loader_class(limits)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, limits)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"the body is not valid YAML or JSON: {e}") from None
    finally:
        loader.dispose()


def _check_nodes(root: Any, limits: BodyLimits) -> None:
    """The number of values of a composed YAML document with its aliases expanded: each node's
    expanded size computed once (an alias is the same node object again), depth first."""
    import yaml

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    size: dict[int, int] = {}
    on_path = {id(root)}
    stack = [(root, iter(children(root)))]
    while stack:
        node, pending = stack[-1]
        for child in pending:
            if id(child) in size:
                continue
            if id(child) in on_path:  # an alias inside its own anchor: no finite expansion
                raise _too_big(limits)
            on_path.add(id(child))
            stack.append((child, iter(children(child))))
            break
        else:
            stack.pop()
            on_path.discard(id(node))
            total = 1 + sum(size[id(c)] for c in children(node))
            if total > limits.nodes:
                raise _too_big(limits)
            size[id(node)] = total
