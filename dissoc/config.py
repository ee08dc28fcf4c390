"""Options from the command line, the environment and a TOML file, in one precedence.

    flag  >  environment (DISSOC_<NAME>)  >  file (--config FILE, or $DISSOC_CONFIG)  >  default

The names are the long flags': ``--max-connections 64`` is ``DISSOC_MAX_CONNECTIONS=64`` in the environment
and ``max-connections = 64`` (or ``max_connections``) at the top level of the file. A switch (``--split``,
``--no-resident``) is a boolean there: ``true``/``false`` in the file, ``1``/``0``, ``true``/``false``,
``yes``/``no`` or ``on``/``off`` in the environment. The positional arguments are ``paths``: a list of
strings in the file, or ``DISSOC_PATHS`` separated like ``PATH`` (``os.pathsep``).

Every value goes through the same checks as the flag's; a value that fails them, or a key of the file that
names no option, is a :class:`ConfigError` that names the key and where it came from. An environment
variable starting with ``DISSOC_`` that names no option is not refused: the environment is
shared with the other commands and tools (``DISSOC_TOKEN`` is ``dissoc get``'s); so only a variable that
looks like an option's (a likely typo) is warned about.

The completed result then fills a dataclass of options (:func:`fill`): each field from the option of its
name, or from the one its ``metadata`` names (:func:`from_option`), so that the way from a flag to the field
it sets is written once, on the field. Nothing here reads sockets or starts servers: it works on an
``argparse`` parser, its result and the dataclass it fills.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dissoc.errors import DissocError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["ENV_PREFIX", "ConfigError", "Layered", "fill", "from_option", "layer", "track_defaults"]

_Options = TypeVar("_Options", bound="DataclassInstance")

#: Environment variables of options start with this, then the flag's name upper-cased with ``_`` for ``-``.
ENV_PREFIX = "DISSOC_"
#: The option naming the configuration file (itself only from the flag or the environment).
CONFIG_KEY = "config"
#: Variables of dissoc's other parts (``dissoc get``'s token, the device backend, the Spark exchange's host,
#: the images' health check, the codec's compiled checks, the UCX transport's C module), never taken for
#: options.
OTHER_VARIABLES = frozenset(
    {
        "DISSOC_TOKEN",
        "DISSOC_CONFIG",
        "DISSOC_DEVICE_BACKEND",
        "DISSOC_SPARK_HOST",
        "DISSOC_HEALTH_URI",
        "DISSOC_JIT",
        "DISSOC_UCX_NATIVE",
    }
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(DissocError):
    """An option from the environment or the configuration file that is unknown or invalid."""


class _Unset:
    """The default every option is given while parsing, so that what the command line set is known."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclass
class Layered:
    """Where each option's value came from: ``"flag"``, ``"env DISSOC_X"``, ``"file F"`` or ``"default"``."""

    sources: dict[str, str] = field(default_factory=dict)
    #: ``DISSOC_*`` variables that name no option but look like one's (each with that option's variable).
    unknown_env: list[tuple[str, str]] = field(default_factory=list)


def track_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Replace the defaults of ``parser``'s options by a marker (so that the ones the command line set are
    known after parsing); returns the real defaults, by destination, for :func:`layer`."""
    defaults: dict[str, Any] = {}
    for action in _options(parser):
        defaults[action.dest] = action.default
        action.default = _UNSET
    return defaults


def layer(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    defaults: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Layered:
    """Fill every option of ``args`` the command line did not set from ``environ`` (default ``os.environ``),
    then from ``config_file`` (TOML), then from ``defaults`` (see :func:`track_defaults`)."""
    environ = os.environ if environ is None else environ
    actions = {_key(a): a for a in _options(parser)}
    result = Layered()
    file_values = _read_file(config_file, actions) if config_file else {}
    option_variables = {ENV_PREFIX + k.upper().replace("-", "_"): k for k in actions if k != CONFIG_KEY}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in OTHER_VARIABLES and name not in option_variables:
            # a variable like an option's but not one is most likely a typo; others are someone else's
            close = difflib.get_close_matches(name, option_variables, n=1, cutoff=0.85)
            if close:
                result.unknown_env.append((name, close[0]))
    for key, action in actions.items():
        dest = action.dest
        if getattr(args, dest, _UNSET) is not _UNSET:
            result.sources[dest] = "flag"
            continue
        env_name = ENV_PREFIX + key.upper().replace("-", "_")
        if env_name in environ and key != CONFIG_KEY:
            where = f"environment variable {env_name}"
            setattr(args, dest, _from_text(action, environ[env_name], where))
            result.sources[dest] = f"env {env_name}"
        elif key in file_values:
            value, where = file_values[key]
            setattr(args, dest, _from_toml(action, value, where))
            result.sources[dest] = where
        else:
            setattr(args, dest, defaults[dest])
            result.sources[dest] = "default"
    return result


def config_path(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str | None:
    """The configuration file named by ``--config`` or ``$DISSOC_CONFIG`` (None: no file)."""
    environ = os.environ if environ is None else environ
    given = getattr(args, CONFIG_KEY, _UNSET)
    if given is not _UNSET and given is not None:
        return str(given)
    return environ.get(ENV_PREFIX + "CONFIG") or None


#: The key of a dataclass field's ``metadata`` naming the option that fills it (see :func:`from_option`).
OPTION_KEY = "dissoc.option"


def from_option(dest: str, convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """A dataclass field's ``metadata`` for a field that :func:`fill` takes from the option ``dest`` (its
    ``argparse`` destination) rather than from the option of the field's own name, through ``convert`` (for
    another unit, say)."""
    return {OPTION_KEY: (dest, convert)}


def fill(cls: type[_Options], args: argparse.Namespace, **given: Any) -> _Options:
    """The dataclass ``cls`` made from ``args``, options completed by :func:`layer`: each field from the
    option of its name, or from the one its ``metadata`` names (:func:`from_option`), converted; ``given``
    over both. A field that no option of ``args`` fills keeps its default; options that fill no field are
    left to the caller. The dataclass checks the values it is given, as it would anyone's."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in given:
            continue
        dest, convert = f.metadata.get(OPTION_KEY, (f.name, None))
        value = getattr(args, dest, _UNSET)
        if value is not _UNSET:
            values[f.name] = value if convert is None else convert(value)
    return cls(**values, **given)


# ------------------------------------------------------------------------------------------------ helpers


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options and positionals that carry a value (not ``--help``)."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.dest != "help"]


def _key(action: argparse.Action) -> str:
    """An option's name in the file and the environment: its first long flag, or a positional's ``dest``."""
    for flag in action.option_strings:
        if flag.startswith("--"):
            return flag[2:]
    return action.dest.replace("_", "-")


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)


def _switch(action: argparse.Action, on: bool) -> bool:
    """The value a switch stores when it is given (``on``) or not."""
    given = isinstance(action, argparse._StoreTrueAction)
    return given if on else not given


def _convert(action: argparse.Action, text: str, where: str) -> Any:
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: invalid value {text!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: invalid value {text!r} (choose from {choices})")
    return value


def _from_text(action: argparse.Action, text: str, where: str) -> Any:
    """A value from the environment, checked as the flag's would be."""
    if _is_switch(action):
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return _switch(action, word in _TRUE)
        raise ConfigError(f"{where}: expected 1/0, true/false, yes/no or on/off, got {text!r}")
    if action.nargs in ("+", "*"):
        items = [part for part in text.split(os.pathsep) if part]
        if action.nargs == "+" and not items:
            raise ConfigError(f"{where}: expected at least one value")
        return [_convert(action, item, where) for item in items]
    return _convert(action, text, where)


def _from_toml(action: argparse.Action, value: object, where: str) -> Any:
    """A value from the file: booleans for switches, lists for many values, the rest as the flag's text."""
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return _switch(action, value)
    if action.nargs in ("+", "*"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        if action.nargs == "+" and not value:
            raise ConfigError(f"{where}: expected at least one value")
        return [_convert(action, v, where) for v in value]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: expected a string or a number, got {value!r}")
    return _convert(action, str(value), where)


def _read_file(path: str, actions: Mapping[str, argparse.Action]) -> dict[str, tuple[object, str]]:
    """The file's values by option name, each with the words that say where it came from."""
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"configuration file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"configuration file {path}: not valid TOML: {e}") from None
    values: dict[str, tuple[object, str]] = {}
    for raw, value in data.items():
        key = raw.replace("_", "-")
        where = f"key {raw!r} of configuration file {path}"
        if key not in actions or key == CONFIG_KEY:
            known = ", ".join(sorted(k for k in actions if k != CONFIG_KEY))
            raise ConfigError(f"{where}: unknown option (known: {known})")
        if key in values:
            raise ConfigError(f"{where}: given twice (as {raw!r} and with '-' or '_' swapped)")
        values[key] = (value, where)
    return values
