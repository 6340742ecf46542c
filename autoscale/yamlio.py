"""YAML read strictly, for every file a user writes (env and suite specs, policy manifests): a key
given twice is an error (PyYAML would keep the last one silently), and a parse error is told as
its problem and its line, on one line."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["load_yaml", "yaml_problem"]


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class says so
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a mapping with a repeated key.

    Raises:
        yaml.YAMLError: malformed YAML or a repeated key (:func:`yaml_problem` says it in a line).
    """
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(exc: yaml.YAMLError) -> str:
    """``found a tab ... (line 5, column 1)``: what is wrong and where, in one line."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if not problem:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"
