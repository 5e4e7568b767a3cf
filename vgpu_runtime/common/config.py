"""Configuration with one precedence everywhere: command-line flags > environment > YAML file.

A daemon declares its settings once, as a frozen dataclass whose fields carry a parser and a
help text (`setting()`). From that one declaration come the flags (`--slices-per-gpu`), the
environment variables (`GEMINI_SLICES_PER_GPU`) and the file keys (`slices_per_gpu`). A bad
value stops start-up with a ConfigError that names the field and where the value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from vgpu_runtime.common import cli
from vgpu_runtime.common.sizes import exact_size, parse_size

ENV_PREFIX = "GEMINI_"
CONFIG_FILE_ENV = "GEMINI_CONFIG"

T = TypeVar("T")
Parser = Callable[[Any], Any]


class ConfigError(ValueError):
    """A setting is malformed; the message names the field and its source."""


def setting(
    default: Any, help: str, parse: Parser | None = None, metavar: str | None = None
) -> Any:
    """Declare one setting of a configuration dataclass."""
    return dataclasses.field(
        default=default,
        metadata={"help": help, "parse": parse or _identity, "metavar": metavar},
    )


def _identity(value: Any) -> Any:
    return value


# ---- parsers: each takes a string (flag, env) or a YAML value, and raises ValueError ----

def integer(minimum: int | None = None, maximum: int | None = None) -> Parser:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ValueError(f"must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ValueError(f"must be at most {maximum}, got {number}")
        return number
    return parse


def number(minimum: float | None = None, maximum: float | None = None) -> Parser:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            result = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: a huge YAML integer
            raise ValueError(f"expected a number, got {value!r}") from None
        if result != result:  # NaN
            raise ValueError("expected a number, got NaN")
        if minimum is not None and result < minimum:
            raise ValueError(f"must be at least {minimum}, got {result}")
        if maximum is not None and result > maximum:
            raise ValueError(f"must be at most {maximum}, got {result}")
        return result
    return parse


def choice(*options: str) -> Parser:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {value!r}")
        return str(value)
    return parse


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def size(value: Any) -> int:
    return parse_size(value)


def int_list(value: Any) -> tuple[int, ...]:
    """A list of integers: YAML list, or '13,31,43' from a flag or the environment."""
    items = value if isinstance(value, list) else [p for p in str(value).split(",") if p.strip()]
    try:
        return tuple(sorted({int(item) for item in items}))
    except (TypeError, ValueError):
        raise ValueError(f"expected a comma-separated list of integers, got {value!r}") from None


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def optional(parse: Parser) -> Parser:
    def parse_optional(value: Any) -> Any:
        if value is None or value == "":
            return None
        return parse(value)
    return parse_optional


# ---- loading ----

def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Add one flag per setting; defaults are left out so that absence is visible."""
    parser.add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS,
        help=f"YAML configuration file (also ${CONFIG_FILE_ENV}); flags and environment win",
    )
    for field in dataclasses.fields(cls):
        meta = field.metadata
        shown = show_default(field.default, meta["parse"])
        default = "" if shown is None else f"; default {shown}"
        parser.add_argument(
            flag_name(field.name), dest=field.name, default=argparse.SUPPRESS,
            metavar=meta.get("metavar") or field.name.upper(),
            # argparse %-formats help texts: a literal % must be doubled.
            help=f"{meta['help']} (env {env_name(field.name)}{default})".replace("%", "%%"),
        )


def show_default(value: Any, parse: Parser) -> str | None:
    """A default as a person would type it (2GiB, 13,31,43, 0.002, true); None for no default."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if parse is size and isinstance(value, int):
        return exact_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(str(item) for item in value)
    return str(value)


def load_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise ConfigError(f"configuration file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"configuration file {path} is not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"configuration file {path} is not UTF-8 text: {err}") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit (fuzzing)
        raise ConfigError(f"configuration file {path} holds an unreadable value: {err}") from None
    except RecursionError:
        raise ConfigError(f"configuration file {path} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {path} must hold a mapping of settings")
    return data


def resolve(
    cls: type[T],
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any],
    file_name: str = "configuration file",
) -> T:
    """Build `cls` from the three sources, flags first."""
    known = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(key) for key in set(file_values) - known)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"{file_name}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        parse: Parser = field.metadata["parse"]
        if field.name in flags:
            source, raw = f"flag {flag_name(field.name)}", flags[field.name]
        elif env_name(field.name) in environ:
            source, raw = f"environment {env_name(field.name)}", environ[env_name(field.name)]
        elif field.name in file_values:
            source, raw = f"{file_name} key {field.name}", file_values[field.name]
        else:
            values[field.name] = field.default
            continue
        try:
            values[field.name] = parse(raw)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None
    return cls(**values)


def load(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Parse argv and the environment into `cls`; raises ConfigError on a bad value."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if prog:
        cli.add_version(parser)
    add_arguments(parser, cls)
    namespace = vars(parser.parse_args(argv))
    config_path = namespace.pop("config", None) or environ.get(CONFIG_FILE_ENV)
    file_values = load_file(config_path) if config_path else {}
    return resolve(cls, namespace, environ, file_values, file_name=config_path or "")
