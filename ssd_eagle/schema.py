"""One schema per configuration, and the YAML files and command-line flags derived from it.

Every configuration (:class:`~ssd_eagle.config.EngineConfig`, :class:`~ssd_eagle.config.SpeculativeConfig`,
:class:`~ssd_eagle.sampling_params.SamplingParams`, :class:`~train.config.TrainConfig`, the server's settings and
the request schemas of :mod:`inference.protocol`) is a :class:`ConfigModel`, so one rule holds everywhere: an
unknown key or a bad value is a ``ValueError`` naming the key (pydantic's ``ValidationError``, or
:class:`ConfigError` from the loaders here). Values are not coerced (``"5"`` is not an integer, ``"no"`` is not a
boolean) and numbers must be finite, except on the command line, where a flag's text is parsed by its field's type:

- numbers and booleans as pydantic parses strings (``3e-4``; ``true``/``false``, ``yes``/``no``, ``1``/``0``),
  ``none`` or ``null`` for an optional field;
- a list takes one or more values and the flag may be repeated (``--stop a --stop b``); numbers may also be
  comma-separated (``--aux_layer_ids 2,15,27``);
- a mapping is YAML (``--extra '{note: x}'``); a nested config stays JSON text (``--speculative-config``), read
  by the code that builds it.

A field ``max_num_seqs`` is the flag ``--max-num-seqs`` (also ``--max_num_seqs`` where the entry point spells both)
and the YAML key ``max_num_seqs`` or ``max-num-seqs``. A boolean ``x`` is ``--x [BOOL]`` (``--x`` alone: true),
and also ``--no-x`` when it defaults to true. Help texts are the fields' descriptions.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

NONE_WORDS = ("none", "null")
_FROM_FIELD = object()  # a Flag attribute taken from the field


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


class ConfigModel(BaseModel):
    """Base of every configuration: unknown keys are refused, types are not coerced, numbers are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def unknown_key(key: str, known, where: str) -> str:
    """``unknown config key 'lrr' in <where> (did you mean lr?); known keys: ...``."""
    close = difflib.get_close_matches(key, list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown config key {key!r} in {where}{hint}; known keys: {', '.join(sorted(known))}"


def describe(err: ValidationError, known=(), where: str = "config") -> str:
    """One line naming each bad key of a pydantic error (with close matches for an unknown top-level key)."""
    parts = []
    for e in err.errors(include_url=False):
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(unknown_key(key, known, where) if len(e["loc"]) == 1 else
                         f"unknown config key {key!r} in {where}")
        elif key:
            parts.append(f"config key {key!r} in {where}: {e['msg']}, got {e['input']!r}")
        else:  # a check across fields: its message names them
            parts.append(e["msg"].removeprefix("Value error, "))
    return "; ".join(parts)


def validated(model: type[BaseModel], values: dict, where: str = "config") -> Any:
    """``model(**values)``, its error turned into a :class:`ConfigError` naming each bad key.

    Raises:
        ConfigError: an unknown key or a bad value (message: :func:`describe`).
    """
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError(describe(err, model.model_fields, where)) from None


class _Loader(yaml.SafeLoader):
    """PyYAML, but ``3e-4`` is a float (YAML 1.2) rather than a string (YAML 1.1 asks for ``3.0e-4``)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def load_yaml(path: str | os.PathLike) -> dict:
    """A YAML file holding a mapping.

    Raises:
        ConfigError: not YAML, or not a mapping. FileNotFoundError: no such file.
    """
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    return data


def _optional(annotation) -> tuple[Any, bool]:
    """(the annotation without None and without its constraints, whether None is allowed)."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else typing.Union[tuple(args)]
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation, optional


def _type_name(annotation, optional: bool) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        name = "one of " + ", ".join(map(str, typing.get_args(annotation)))
    elif isinstance(annotation, type):
        name = annotation.__name__
    else:
        name = str(annotation).replace("typing.", "")
    return name + (" or none" if optional else "")


@dataclass(frozen=True)
class Flag:
    """A command-line flag and serve-YAML key for one field of a config model.

    Attributes:
        model, field: the schema the value is validated against.
        dest: the attribute of the parsed namespace (default: ``field``).
        names: the option strings (default: ``--field-with-dashes``).
        default: the value when neither the command line nor a YAML file gives one (default: the field's).
        help: the help text (default: the field's description).
    """

    model: type[BaseModel]
    field: str
    dest: str = ""
    names: tuple[str, ...] = ()
    default: Any = _FROM_FIELD
    help: str | None = None

    def __post_init__(self) -> None:
        info = self.model.model_fields[self.field]
        set_ = functools.partial(object.__setattr__, self)
        set_("dest", self.dest or self.field)
        set_("names", self.names or (f"--{self.dest.replace('_', '-')}",))
        if self.default is _FROM_FIELD:
            set_("default", info.get_default(call_default_factory=True))
        set_("help", self.help if self.help is not None else info.description)

    @property
    def _type(self):
        return _optional(self.model.model_fields[self.field].annotation)

    @property
    def _kind(self) -> str:
        inner, _ = self._type
        if inner is bool:
            return "bool"
        if typing.get_origin(inner) is list:
            return "list"
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return "json"
        return "dict" if inner is dict or typing.get_origin(inner) is dict else "scalar"

    def add_to(self, parser) -> None:
        """Add the flag (every default suppressed: the namespace holds only what the command line gave)."""
        inner, _ = self._type
        shown = self.default if not isinstance(self.default, str) else repr(self.default)
        text = self.help or ""
        if "default:" not in text:
            text += f"{' ' if text else ''}(default: {shown})"
        common = dict(dest=self.dest, default=argparse.SUPPRESS, help=text)
        if self._kind == "bool":
            parser.add_argument(*self.names, nargs="?", const="true", metavar="BOOL", **common)
            if self.default is True:
                parser.add_argument("--no-" + self.names[0].removeprefix("--"), action="store_const", const="false",
                                    dest=self.dest, default=argparse.SUPPRESS, help=f"same as {self.names[0]} false")
        elif self._kind == "list":
            parser.add_argument(*self.names, nargs="+", action="extend", **common)
        else:
            choices = typing.get_args(inner) if typing.get_origin(inner) is typing.Literal else None
            parser.add_argument(*self.names, metavar="{" + ",".join(choices) + "}" if choices else None, **common)

    @functools.cached_property
    def _adapter(self) -> TypeAdapter:
        info = self.model.model_fields[self.field]
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        return TypeAdapter(annotation, config=ConfigDict(allow_inf_nan=False))

    def from_text(self, text: str | list[str]) -> Any:
        """The command line's text as the field's value.

        Raises:
            ConfigError: text the field's type does not parse, naming the flag and the key.
        """
        inner, optional = self._type
        kind = self._kind
        if kind == "json":
            return text
        if kind == "list" and typing.get_args(inner)[0] is str:
            value = list(text)
        elif kind == "list":
            value = [part for token in text for part in token.split(",") if part.strip()]
        elif optional and text.strip().lower() in NONE_WORDS:
            return None
        elif kind == "dict":
            value = yaml.load(text, Loader=_Loader)
        else:
            value = text
        try:
            return self._adapter.validate_python(value, strict=False)
        except ValidationError as err:
            why = "; ".join(e["msg"] for e in err.errors(include_url=False))
            raise ConfigError(f"{self.names[0]}: config key {self.dest!r} expects {_type_name(inner, optional)}, "
                              f"got {text!r} ({why})") from None

    def from_yaml(self, value: Any, where: str) -> Any:
        """A YAML value (strictly typed; one value for a list field: a list of it).

        Raises:
            ConfigError: a value of the wrong type or out of range, naming the key.
        """
        if self._kind == "json":
            return value if isinstance(value, str) else json.dumps(value)
        if self._kind == "list" and not isinstance(value, list):
            value = [value]
        try:
            return self._adapter.validate_python(value, strict=True)
        except ValidationError as err:
            why = "; ".join(e["msg"] for e in err.errors(include_url=False))
            raise ConfigError(f"{where}: config key {self.dest!r}: {why}, got {value!r}") from None


def flags_for(model: type[BaseModel], fields=None, exclude=(), both_spellings: bool = False) -> list[Flag]:
    """A :class:`Flag` per field of ``model`` (``fields`` in their order, or all but ``exclude``);
    ``both_spellings``: ``--ttt_steps`` as well as ``--ttt-steps``."""
    out = []
    for name in fields or [n for n in model.model_fields if n not in exclude]:
        names = tuple(dict.fromkeys((f"--{name}", f"--{name.replace('_', '-')}"))) if both_spellings else ()
        out.append(Flag(model, name, names=names))
    return out


def add_flags(parser, flags) -> None:
    """Add every flag to ``parser`` (an ``argparse`` parser or argument group)."""
    for flag in flags:
        flag.add_to(parser)


def command_line_values(flags, namespace: argparse.Namespace) -> dict:
    """The flags the command line gave, parsed (:meth:`Flag.from_text`), by ``dest``."""
    given = vars(namespace)
    return {f.dest: f.from_text(given[f.dest]) for f in flags if f.dest in given}


def yaml_values(flags, path: str | os.PathLike) -> dict:
    """A YAML file of flag values (keys: the flags' ``dest`` with underscores or dashes), by ``dest``; ``null``
    leaves the flag at its default.

    Raises:
        ConfigError: an unknown key, a bad value, not a mapping. FileNotFoundError: no such file.
    """
    by_dest = {f.dest: f for f in flags}
    out = {}
    for key, value in load_yaml(path).items():
        flag = by_dest.get(str(key).replace("-", "_"))
        if flag is None:
            raise ConfigError(unknown_key(str(key), by_dest, str(path)))
        if value is not None:
            out[flag.dest] = flag.from_yaml(value, str(path))
    return out


def parse_flags(parser: argparse.ArgumentParser, flags, argv: list[str] | None = None,
                defaults: dict | None = None) -> argparse.Namespace:
    """Parse ``argv``: each flag's value is its default (``defaults`` over the field's), then the ``--config``
    YAML file's (when the parser has that option and it is given), then the command line's.

    Exits (``parser.error``) with a message naming a bad key or flag.
    """
    namespace = parser.parse_args(argv)
    values = {f.dest: f.default for f in flags} | (defaults or {})
    try:
        if getattr(namespace, "config", None):
            values.update(yaml_values(flags, namespace.config))
        values.update(command_line_values(flags, namespace))
    except (ValueError, OSError) as err:
        parser.error(str(err))
    return argparse.Namespace(**{**vars(namespace), **values})
