"""A YAML tree into typed dataclasses, strictly (the torchtitan style): the machinery under
`pipeline.config`, which holds the run config's sections.

    cfg = from_tree(Config, yaml.safe_load(text), where="configs/x.yaml")   # ConfigError on any mistake
    describe(Config)                                                         # (key, default, doc) rows

A field's docstring is the string literal right after it; an unknown key, a value of the wrong type
or a section that is not a mapping raises `ConfigError` with one line naming the file and the key.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line for the user."""


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written as string literals right after each field (the torchtitan style), of `cls` and of
    the dataclasses it extends (a class made at run time, with dataclasses.make_dataclass, has no source:
    its own fields are sections, documented field by field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = str(nxt.value.value)
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field of a dataclass, nested sections as dotted keys."""
    rows = []
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, repr(default), docs.get(f.name, "")))
            item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if dataclasses.is_dataclass(item):  # a list of sections: each item's keys
                rows += describe(item, f"{prefix}{f.name}[].")
    return rows


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "[" + ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(tp)) + "]"
    if origin is dict:
        return "mapping"
    if origin is list:
        return f"list of {_type_name(args[0]) if (args := typing.get_args(tp)) else 'values'}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (list -> tuple, int -> float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{where}: key '{key}' expects {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                pass
        raise bad
    if origin is Literal:
        if value in args:
            return value
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[float, ...]: any length
        if not isinstance(value, (list, tuple)) or not value:
            raise bad
        return tuple(_coerce(v, args[0], key, where) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(v, a, key, where) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if origin is list:  # a list of sections (data.sources): each item checked as its section, named by index
        if not isinstance(value, (list, tuple)):
            raise bad
        item = args[0]
        if dataclasses.is_dataclass(item):
            return [from_tree(item, v, where, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_coerce(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # PyYAML reads '3e-4' (no dot) as a string; it is a number to a user
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"unsupported annotation {tp} for {key}")


def from_tree(cls: type, data: dict[str, Any], where: str, prefix: str = "") -> Any:
    """The dataclass `cls` from a nested dict: an unknown key, a wrong type or a non-mapping section is a
    ConfigError naming `where` and the dotted key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: section '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'; valid keys here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_tree(tp, data[name] or {}, where, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(data[name], tp, prefix + name, where)
    return cls(**kwargs)


def read_tree(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a plain tree (ConfigError when missing or not YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return tree


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` in `tree`; a list of sections is entered by an item's name or index
    (data.sources.web.weight=0.2, data.sources.0.weight=0.2)."""
    node: Any = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = _list_item(node, part, dotted) if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
    if isinstance(node, list):
        raise ConfigError(f"override '{dotted}': name an item of the list ('{leaf}.KEY=...'), or set the whole list")
    node[leaf] = value


def _list_item(items: list[Any], part: str, dotted: str) -> Any:
    named = [x for x in items if isinstance(x, dict) and x.get("name") == part]
    if named:
        return named[0]
    if part.isdigit() and int(part) < len(items):
        return items[int(part)]
    names = [str(x.get("name")) for x in items if isinstance(x, dict)]
    raise ConfigError(f"override '{dotted}': no item '{part}' in the list (names: {', '.join(names) or 'none'}; "
                      f"or an index below {len(items)})")


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=3e-4' -> ('train.lr', 0.0003). Values are YAML scalars or flow lists ([224, 320])."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e.problem})") from None
    # YAML 1.1 reads '3e-4' as a string; accept numbers written that way.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return key.strip(), value
