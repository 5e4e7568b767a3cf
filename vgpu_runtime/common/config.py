"""Configuration with one precedence everywhere: command-line flags > environment > YAML file.

A daemon declares its settings once, as a frozen dataclass whose fields carry a parser and a
help text (`setting()`). From that one declaration come the flags (`--slices-per-gpu`), the
environment variables (`GEMINI_SLICES_PER_GPU`) and the file keys (`slices_per_gpu`). A bad
value stops start-up with a ConfigError that names the field and where the value came from.

The node's file (version v1) has a section per program and a `node` section for the settings
every program must agree on, named once:

    version: v1
    node: {slices_per_gpu: 10, state_dir: /var/lib/gemini}
    devicePlugin: {placement: best-fit}
    scheduler: {limit_policy: work-conserving}

The `node` keys are NodeSettings' fields; a program takes those it declares (`node_setting()`)
and its own section (the class's SECTION), and ignores the other sections. A node setting in a
program's section, or an unknown key in either, stops the program with the file, section and
key. A file without `version:` is read as the older flat file of one program's keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import yaml

from vgpu_runtime.common import cli
from vgpu_runtime.common.sizes import exact_size, parse_size
from vgpu_runtime.contracts import paths

ENV_PREFIX = "GEMINI_"
CONFIG_FILE_ENV = "GEMINI_CONFIG"
FILE_VERSION = "v1"
NODE_SECTION = "node"
# The program sections of a version v1 file and whose they are; any other top-level key is an
# error, so a misspelled section cannot leave a program silently on its defaults.
PROGRAM_SECTIONS = {"devicePlugin": "gemini-device-plugin", "scheduler": "gemini-daemon"}
DEPRECATED_FLAT_FILE = (
    "configuration file {path} has no version: read as a flat file of this program's settings, "
    "which is deprecated; move its keys under the program's section of a version v1 file "
    "(daemonset/README.md, 'Configuration')")

T = TypeVar("T")
Parser = Callable[[Any], Any]

# Hostile files: a 404-byte file of nested YAML aliases expanded to billions of
# nodes when an error message printed the value, and killed the program. A file is read only
# up to MAX_FILE_BYTES; its aliases may expand it to at most MAX_EXPANDED_NODES nodes; an
# error quotes at most QUOTE_CHARS of a value.
MAX_FILE_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000
QUOTE_CHARS = 80
_QUOTER = reprlib.Repr()
_QUOTER.maxlevel = 2
_QUOTER.maxdict = _QUOTER.maxlist = _QUOTER.maxtuple = _QUOTER.maxset = 4
_QUOTER.maxstring = _QUOTER.maxother = _QUOTER.maxlong = QUOTE_CHARS


def quote(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to a short prefix, at a cost that
    does not grow with the value (nested lists and mappings are not walked past two levels)."""
    shown = _QUOTER.repr(value)
    return shown if len(shown) <= QUOTE_CHARS else shown[:QUOTE_CHARS - 3] + "..."


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
            raise ValueError(f"expected an integer, got {quote(value)}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {quote(value)}") from None
        if minimum is not None and number < minimum:
            raise ValueError(f"must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ValueError(f"must be at most {maximum}, got {number}")
        return number
    return parse


def number(minimum: float | None = None, maximum: float | None = None) -> Parser:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {quote(value)}")
        try:
            result = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: a huge YAML integer
            raise ValueError(f"expected a number, got {quote(value)}") from None
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
            raise ValueError(f"must be one of {', '.join(options)}; got {quote(value)}")
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
    raise ValueError(f"expected true or false, got {quote(value)}")


def size(value: Any) -> int:
    return parse_size(value)


def int_list(value: Any) -> tuple[int, ...]:
    """A list of integers: YAML list, or '13,31,43' from a flag or the environment."""
    items = value if isinstance(value, list) else [p for p in str(value).split(",") if p.strip()]
    try:
        return tuple(sorted({int(item) for item in items}))
    except (TypeError, ValueError):
        raise ValueError("expected a comma-separated list of integers, got "
                         f"{quote(value)}") from None


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {quote(value)}")
    return value


def optional(parse: Parser) -> Parser:
    def parse_optional(value: Any) -> Any:
        if value is None or value == "":
            return None
        return parse(value)
    return parse_optional


def resource_name(value: Any) -> str:
    """<domain>/<name>, as an extended resource or a CDI kind is named."""
    name = text(value)
    domain, slash, short = name.partition("/")
    if not slash or not domain or not short or "/" in short:
        raise ValueError(f"expected <domain>/<name> such as gemini.ai/vgpu, got {value!r}")
    return name


# ---- the node section ----

@dataclass(frozen=True)
class NodeSettings:
    """The `node` section: what every program on the node must agree on, named once."""
    state_dir: str = setting(paths.DEFAULT_STATE_DIR,
                             "node state directory (allocation records, channels)", text, "DIR")
    slices_per_gpu: int = setting(10, "devices (slices) advertised per GPU",
                                  integer(1, paths.MAX_SLICES_PER_GPU), "N")
    # The plugin advertises it; the daemon finds the pods holding it in kubelet's PodResources.
    resource_name: str = setting(paths.RESOURCE_NAME, "extended resource the slices are "
                                 "advertised as", resource_name, "NAME")
    simulate_gpus: int = setting(0, "simulate N GPUs instead of using NVML (0 = NVML)",
                                 integer(0, 256), "N")
    simulate_model: str = setting("Simulated NVIDIA H200", "model name of simulated GPUs", text,
                                  "NAME")
    # The daemon runs the tenants over MPS; the plugin gives each container its pipes.
    mps: bool = setting(False, "run the tenants over an MPS control daemon of the state "
                        "directory (every tenant gets all the threads; the tokens keep the "
                        "shares): co-held kernels then run side by side", boolean, "BOOL")


_NODE_FIELDS = {f.name: f for f in dataclasses.fields(NodeSettings)}


def node_setting(name: str, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
    """A program's copy of a node setting: NodeSettings' parser, help and default (or
    `default`), read from the file's `node` section and refused in the program's own."""
    source = _NODE_FIELDS[name]
    meta = dict(source.metadata)
    meta["node"] = True
    if help is not None:
        meta["help"] = help
    value = source.default if default is dataclasses.MISSING else default
    return dataclasses.field(default=value, metadata=meta)


def node_fields(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("node")}


def section_of(cls: type[Any]) -> str | None:
    """The class's own section of a v1 file (its SECTION class attribute), if it has one."""
    section: str | None = getattr(cls, "SECTION", None)
    return section


def file_settings(cls: type[Any], data: Mapping[str, Any], path: str,
                  notes: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings a file gives `cls`, and where each came from ("<file>, section node").

    A v1 file gives the node keys `cls` declares and its own section's keys; a file without
    `version:` is the flat file of one program (a deprecation note is added to `notes`)."""
    if "version" not in data:
        if data and notes is not None:
            notes.append(DEPRECATED_FLAT_FILE.format(path=path))
        return dict(data), {str(key): path for key in data}
    version = data["version"]
    if version != FILE_VERSION:
        raise ConfigError(f"{path}: version {quote(version)} is not supported; this program reads "
                          f"version: {FILE_VERSION} (or a flat file without version:, "
                          "deprecated)")
    known_sections = ["version", NODE_SECTION, *PROGRAM_SECTIONS]
    unknown = sorted(str(key) for key in data if key not in known_sections)
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; a version "
                          f"{FILE_VERSION} file has {', '.join(known_sections)}")
    node = _section(data, NODE_SECTION, path)
    _check_keys(node, set(_NODE_FIELDS), path, NODE_SECTION)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    wanted = node_fields(cls)
    for key, value in node.items():
        if key in wanted:
            values[key], where[key] = value, f"{path}, section {NODE_SECTION}"
    own_section = section_of(cls)
    if own_section is not None:
        own = _section(data, own_section, path)
        shared = sorted(str(key) for key in own if key in _NODE_FIELDS)
        if shared:
            raise ConfigError(f"{path}, section {own_section}: {', '.join(shared)} "
                              f"{'is a node setting' if len(shared) == 1 else 'are node settings'}"
                              f"; set {'it' if len(shared) == 1 else 'them'} once, under "
                              f"{NODE_SECTION}:")
        _check_keys(own, {f.name for f in dataclasses.fields(cls)} - wanted, path, own_section)
        for key, value in own.items():
            values[key], where[key] = value, f"{path}, section {own_section}"
    return values, where


def _section(data: Mapping[str, Any], name: str, path: str) -> Mapping[str, Any]:
    section = data.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}, section {name}: must be a mapping of settings, got "
                          f"{type(section).__name__}")
    return section


def _check_keys(values: Mapping[str, Any], known: set[str], path: str, section: str) -> None:
    unknown = sorted(str(key) for key in values if key not in known)
    if unknown:
        raise ConfigError(f"{path}, section {section}: unknown setting(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")


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


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand it past MAX_EXPANDED_NODES."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
        return node


def _check_expansion(root: yaml.Node) -> None:
    """Counts the nodes the document would have with every alias expanded (each shared node
    once per reference), without expanding anything: O(distinct nodes). An alias inside what
    it names (a recursive structure) is refused too: no setting is one."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        if not children_done:
            if id(node) in sizes:
                continue
            if any(id(child) in open_nodes for child in children) or id(node) in open_nodes:
                raise ConfigError("a YAML alias refers to a value that contains it")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        open_nodes.discard(id(node))
        total = 1 + sum(sizes[id(child)] for child in children)
        if total > MAX_EXPANDED_NODES:
            raise ConfigError(f"its aliases expand it past {MAX_EXPANDED_NODES:,} values "
                              "(nested YAML aliases are refused)")
        sizes[id(node)] = total


def read_file(path: str) -> bytes:
    """The file's bytes, for load_file; raises ConfigError."""
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"configuration file {path}: {err.strerror}") from None


def load_file(path: str, raw: bytes | None = None) -> dict[str, Any]:
    """The file's settings; from `raw`, its bytes as read already, where given."""
    try:
        if raw is None:
            raw = read_file(path)
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(f"configuration file {path} is larger than "
                              f"{MAX_FILE_BYTES // 1024} KiB; a node's configuration is a few "
                              "lines")
        data = yaml.load(raw.decode("utf-8"), Loader=_BoundedLoader)
    except ConfigError as err:
        if str(err).startswith("configuration file"):
            raise
        raise ConfigError(f"configuration file {path}: {err}") from None
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
    where: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from the three sources, flags first. `file_values` are flat settings;
    `where` names the file (and section) of each, else `file_name` does."""
    known = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(key) for key in set(file_values) - known)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"{file_name}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    where = where or {}
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        parse: Parser = field.metadata["parse"]
        if field.name in flags:
            source, raw = f"flag {flag_name(field.name)}", flags[field.name]
        elif env_name(field.name) in environ:
            source, raw = f"environment {env_name(field.name)}", environ[env_name(field.name)]
        elif field.name in file_values:
            source = f"{where.get(field.name, file_name)} key {field.name}"
            raw = file_values[field.name]
        else:
            values[field.name] = field.default
            continue
        try:
            values[field.name] = parse(raw)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None
    return cls(**values)


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """A configuration and what it was resolved from, so the file can be read again."""
    config: T
    path: str | None
    flags: Mapping[str, Any]
    environ: Mapping[str, str]
    notes: tuple[str, ...] = ()
    raw: bytes | None = None   # the file's bytes the configuration was read from

    def reread(self, raw: bytes | None = None) -> T:
        """The configuration the file now gives (or its bytes `raw`, as read already), with the
        same flags and environment."""
        cls = type(self.config)
        values, where = file_settings(cls, load_file(self.path, raw), self.path) if self.path \
            else ({}, {})
        return resolve(cls, self.flags, self.environ, values, self.path or "", where)


def load_all(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> Loaded[T]:
    """Parse argv, the environment and the file into `cls`; raises ConfigError."""
    environ = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if prog:
        cli.add_version(parser)
    add_arguments(parser, cls)
    namespace = vars(parser.parse_args(argv))
    config_path = namespace.pop("config", None) or environ.get(CONFIG_FILE_ENV) or None
    notes: list[str] = []
    raw = read_file(config_path) if config_path else None
    values, where = (file_settings(cls, load_file(config_path, raw), config_path, notes)
                     if config_path else ({}, {}))
    config = resolve(cls, namespace, environ, values, config_path or "", where)
    return Loaded(config, config_path, namespace, environ, tuple(notes), raw)


def load(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> T:
    """Parse argv and the environment into `cls`; raises ConfigError on a bad value."""
    return load_all(cls, argv, environ, prog, description).config
