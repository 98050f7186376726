"""The configuration table of docs/configuration.md: every key `GatewayConfig` takes,
walked from the pydantic schema (a key's meaning is its field's `description=`), with
its type, default, unit, scope and when it takes effect."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic.fields import FieldInfo

from gateway.config import GatewayConfig
from gateway.config.loading import RENAMED
from gateway.config.reload import SWITCHES, reloads
from gateway.config.workers import WORKER_URL_KEYS, WorkerSpec
from scripts.docs_gen.blocks import markdown_table
from scripts.docs_gen.config_facts import (
    DEFAULT_AT,
    MAPPING_KEYS,
    NAMED_TYPES,
    NOT_IN_SCHEMA,
    PICKER_TLS,
    RELOAD,
    SCOPE,
    TYPE_AT,
    UNIT_AT,
    UNIT_BY_NAME,
)


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the configuration table."""

    path: str
    type: str
    default: str
    unit: str
    reload: str
    scope: str
    meaning: str


ABSENT = object()  # the default of a section that is off unless given


@dataclasses.dataclass(frozen=True)
class _Found:
    path: str
    hint: Any
    default: Any
    meaning: str | None  # None: nobody said (the generator stops)


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _strip(hint: Any) -> tuple[Any, bool]:
    """The type without `| None` (and without Annotated around a section); whether it was
    optional."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    if typing.get_origin(hint) is Annotated and _is_section(typing.get_args(hint)[0]):
        hint = typing.get_args(hint)[0]
    return hint, optional


def _default(info: FieldInfo) -> Any:
    """A field's default as pydantic has it (a `Field(default=...)` is no plain dataclass
    default), a factory's called; MISSING: required."""
    if info.is_required():
        return dataclasses.MISSING
    return info.get_default(call_default_factory=True, validated_data={})


def _fields(cls: type, prefix: str, skip: Sequence[str] = ()) -> Iterator[_Found]:
    """The keys of a section: each field's, with the field's `description` as meaning."""
    hints = typing.get_type_hints(cls, include_extras=True)
    infos: Mapping[str, FieldInfo] = getattr(cls, "__pydantic_fields__")  # noqa: B009
    for field in dataclasses.fields(cls):
        if field.name not in skip:
            info = infos[field.name]
            path = f"{prefix}{field.name}"
            yield from _walk(path, hints[field.name], _default(info), info.description)


def _sources(hint: Any) -> tuple[type, ...]:
    """The sections of a tagged union (`Annotated[A | B, Field(discriminator=...)]`)."""
    if typing.get_origin(hint) is not Annotated:
        return ()
    members = typing.get_args(typing.get_args(hint)[0])
    return members if members and all(_is_section(m) for m in members) else ()


def _walk(path: str, hint: Any, default: Any, meaning: str | None) -> Iterator[_Found]:
    """Every key under `path`: a section's keys, a list's entries, a mapping's values.
    `meaning`: the field's description, for the row of `path` itself."""
    inner, optional = _strip(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if _is_section(inner):
        if optional:  # a section that is off unless given (flow:)
            yield _Found(path, "section", ABSENT, meaning)
        yield from _fields(inner, f"{path}.")
    elif origin is tuple and _strip(args[0])[0] is WorkerSpec:
        yield _Found(path + "[]", "worker URL \\| mapping", default, meaning)
        yield _unlike_schema(path + "[].url", str, dataclasses.MISSING)
        kept = [f.name for f in dataclasses.fields(WorkerSpec) if f.name not in WORKER_URL_KEYS]
        yield from _fields(WorkerSpec, f"{path}[].", skip=kept)
    elif origin is tuple and _sources(args[0]):  # discovery sources
        sources = _sources(args[0])
        tags = [typing.get_args(typing.get_type_hints(s)["source"])[0] for s in sources]
        yield _Found(path + "[]", "list", default, meaning)
        yield _unlike_schema(path + "[].source", Literal[tuple(tags)], dataclasses.MISSING)
        for source, tag in zip(sources, tags, strict=True):
            yield from _fields(source, f"{path}[{tag}].", skip=("source",))
    elif origin is tuple and _is_section(args[0]):  # flow.classes
        yield _Found(path, "list of mappings", default, meaning)
        yield from _fields(args[0], f"{path}[].")
    elif origin is Mapping:
        yield _Found(path, "mapping", default, meaning)
        yield from _fields(args[1], f"{path}.{MAPPING_KEYS[path]}.")
    else:
        yield _Found(path, hint, default, PICKER_TLS.get(path, meaning))


def _unlike_schema(path: str, hint: Any, default: Any) -> _Found:
    """A key that is no field of the schema: its meaning from NOT_IN_SCHEMA."""
    return _Found(path, hint, default, NOT_IN_SCHEMA.get(path))


def _bound(meta: Sequence[Any]) -> str:
    """`≥ 1`, `> 0`, `0..1`, `non-empty` from pydantic's Field and annotated-types."""
    found: dict[str, Any] = {}
    for item in meta:
        for each in getattr(item, "metadata", [item]):
            for attr in ("ge", "gt", "le", "lt", "min_length"):
                if getattr(each, attr, None) is not None:
                    found[attr] = getattr(each, attr)
    if "ge" in found and "le" in found:
        return f"{found['ge']}..{found['le']}"
    parts = [f"{sign} {found[attr]}" for attr, sign in (("ge", "≥"), ("gt", ">")) if attr in found]
    parts += [f"{sign} {found[attr]}" for attr, sign in (("le", "≤"), ("lt", "<")) if attr in found]
    if found.get("min_length"):
        parts.append("(non-empty)")
    return ", ".join(parts)


def render_type(hint: Any) -> str:
    if isinstance(hint, str):
        return hint
    for named, text in NAMED_TYPES:
        if hint == named:
            return text
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, bound = render_type(args[0]), _bound(args[1:])
        return f"{base} {bound}" if bound else base
    if origin in (typing.Union, types.UnionType):
        shown = [render_type(a) for a in args if a is not type(None)]
        return " \\| ".join(shown) + (" \\| null" if type(None) in args else "")
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return f"list of {render_type(args[0])}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in hint)
    names = {bool: "bool", int: "int", float: "number", str: "string"}
    if hint in names:
        return names[hint]
    raise ValueError(f"no rendering for the type {hint!r}: add it to NAMED_TYPES")


def render_default(value: Any, unit: str) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is ABSENT:
        return "absent"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        if unit == "bytes" and value >= 1024:
            size = value / 1024**2 if value >= 1024**2 else value / 1024
            return f"{value} ({size:g} {'MiB' if value >= 1024**2 else 'KiB'})"
        return str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return ", ".join(_entry(v) for v in value)  # flow.classes
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value) if value else "`[]`"
    if isinstance(value, Mapping) and not value:
        return "`{}`"
    return str(value)


def _entry(value: Any) -> str:
    """A default list entry: `name` (its other fields that are set)."""
    fields = dataclasses.asdict(value)
    rest = [f"{k} {render_default(v, '')}" for k, v in fields.items() if k != "name" and v]
    return f"`{fields['name']}` ({', '.join(rest)})"


def unit_of(path: str) -> str:
    if path in UNIT_AT:
        return UNIT_AT[path]
    name = path.rpartition(".")[2]
    return next((unit for pattern, unit in UNIT_BY_NAME if re.search(pattern, name)), "")


def config_keys() -> list[Key]:
    """Every key `GatewayConfig` takes, with its renamed sections, in the schema's order."""
    found = list(_fields(GatewayConfig, ""))
    found += [_unlike_schema(old, f"section (= `{new}`)", ABSENT) for old, new in RENAMED.items()]
    paths = [f.path for f in found]
    undescribed = [f.path for f in found if not f.meaning]
    gone = [p for p in (*NOT_IN_SCHEMA, *PICKER_TLS, *SCOPE, *RELOAD) if p not in paths]
    if undescribed or gone:
        raise SystemExit(
            "scripts/gen_docs.py: "
            + (
                f"keys without a meaning (give the field a `description=` in gateway/config; "
                f"NOT_IN_SCHEMA is for keys that are no field): {undescribed}; "
                if undescribed
                else ""
            )
            + (f"entries for keys that no longer exist: {sorted(set(gone))}" if gone else "")
        )
    keys = []
    for f in found:
        unit = unit_of(f.path) if not isinstance(f.hint, str) else ""
        keys.append(
            Key(
                path=f.path,
                type=TYPE_AT.get(f.path) or render_type(f.hint),
                default=DEFAULT_AT.get(f.path) or render_default(f.default, unit),
                unit=unit,
                reload=takes_effect(f.path),
                scope=SCOPE.get(f.path, ""),
                meaning=f.meaning or "",
            )
        )
    return keys


def takes_effect(path: str) -> str:
    """`reload` for the keys gateway.config.reload lists (a switch's on/off: restart),
    else `restart`; RELOAD adds what more there is to say."""
    said = RELOAD.get(path)
    if not reloads(path):
        return said or "restart"
    if path in SWITCHES:
        return "reload (on or off: restart)"
    if said is not None:
        return said.replace("restart", "reload", 1)
    return "reload"


def config_table() -> str:
    return markdown_table(
        ("key", "type", "default", "unit", "takes effect", "scope", "meaning"),
        (
            (f"`{k.path}`", k.type, k.default, k.unit, k.reload, k.scope, k.meaning)
            for k in config_keys()
        ),
    )
