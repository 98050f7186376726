"""From outside to settings: the YAML file, the flags merged in, worker URLs and lists,
and every problem told in one line (`limits.max_choices: must be at least 1, not 0`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from gateway.config.addresses import host_port, is_loopback, parse_address
from gateway.config.discovery import DISCOVERY_TAGS
from gateway.config.errors import ConfigError, show
from gateway.config.flow import check_tenant_classes
from gateway.config.gateway import SECTIONS, GatewayConfig
from gateway.config.models import ModelSettings, route_problem, routes_of
from gateway.config.picker import picker_tls
from gateway.config.served import route_targets
from gateway.config.workers import MAX_URL, WorkerEntry, WorkerSpec, check_workers
from gateway.core.policy_names import policy_names

log = structlog.get_logger("gateway.config")

# -- reading the file --------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that also refuses a key given twice in one mapping (YAML
    forbids it; PyYAML would keep the last value without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: the keys it brings may be overridden here
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error says so
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found key {key!r} twice",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(exc.problem or exc.context or "").split())
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"not valid YAML{where}: {problem}" if problem else f"not valid YAML{where}"
    return f"not valid YAML ({' '.join(str(exc).split())})"


def load_file(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: {exc.strerror or exc}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r}: not UTF-8 (byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader) or {}  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping")
    return data


# -- one line per problem ----------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[^.\[\]'\"\s]+")


def _path(loc: Sequence[int | str]) -> str:
    """`limits.max_choices`, `workers[0].role`, `models['qwen2.5:7b'].policy`."""
    text = ""
    for i, item in enumerate(loc):
        if item == "[key]":  # the mapping key itself was wrong: the path names it already
            continue
        if item in DISCOVERY_TAGS and "discovery" in loc[max(0, i - 2) : i]:
            continue  # the union member pydantic tried: not a key of the file
        if isinstance(item, int):
            text += f"[{item}]"
        elif _PLAIN_KEY.fullmatch(item):
            text += f".{item}" if text else item
        else:
            text += f"[{item!r}]"
    return text


def _bool_hint(value: Any, loc: Sequence[int | str]) -> str:
    """YAML 1.1 reads bare on/off/yes/no as booleans, where a string was meant."""
    if value is True:
        return " (YAML reads a bare on, yes or true as true: put the value in quotes)"
    if value is False and tuple(loc[-2:]) == ("metrics", "listen"):
        return " (YAML reads a bare off as false: write listen: 'off' to turn metrics off)"
    if value is False:
        return " (YAML reads a bare off, no or false as false: put the value in quotes)"
    return ""


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _choices(expected: str) -> str:
    """`'a', 'b' or 'c'` (pydantic's list of allowed values) as `a|b|c`."""
    return "|".join(re.findall(r"'([^']*)'", expected))


def _message(error: ErrorDetails) -> str:
    """What is wrong, without the path."""
    kind, value, ctx = error["type"], error["input"], error.get("ctx") or {}
    loc = error["loc"]
    shown = show(value)
    if kind in ("config", "config_line"):
        return str(ctx["message"])
    if kind == "worker_url":
        return f"{ctx['url']}: {ctx['problem']}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be a whole number, not {shown}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number, not {shown}"
    if kind == "finite_number":
        return f"must be a finite number, not {shown}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, not {shown}"
    if kind == "string_type":
        return f"must be a string, not {shown}{_bool_hint(value, loc)}"
    if kind in ("list_type", "tuple_type", "set_type", "iterable_type"):
        return f"must be a list, not {shown}"
    if kind in ("dict_type", "mapping_type", "dataclass_type", "dataclass_exact_type"):
        return f"must be a mapping, not {shown}"
    if kind == "greater_than_equal":
        return f"must be at least {_number(ctx['ge'])}, not {shown}"
    if kind == "greater_than":
        return f"must be greater than {_number(ctx['gt'])}, not {shown}"
    if kind == "less_than_equal":
        return f"must be at most {_number(ctx['le'])}, not {shown}"
    if kind == "less_than":
        return f"must be less than {_number(ctx['lt'])}, not {shown}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind in ("literal_error", "enum"):
        what = "policy" if loc and loc[-1] in ("policy", "default_policy") else "value"
        expected = _choices(str(ctx.get("expected", "")))
        return f"unknown {what} {shown} (expected {expected})"
    if kind in ("missing", "missing_argument"):
        return "must be given"
    if kind == "union_tag_invalid":
        return f"unknown source {show(ctx.get('tag'))} (expected {'|'.join(DISCOVERY_TAGS)})"
    if kind == "union_tag_not_found":
        return f"needs a source ({'|'.join(DISCOVERY_TAGS)})"
    return str(error["msg"]).replace("Input should be", "must be").replace("Value error, ", "")


def _known_keys(parent: Sequence[int | str]) -> tuple[str, ...]:
    """The keys a section takes, for an unknown-key message (none listed at the top)."""
    section = str(parent[0]) if len(parent) == 1 else ""
    if RENAMED.get(section, section) in SECTIONS:
        cls = SECTIONS[RENAMED.get(section, section)]
    elif len(parent) == 2 and parent[0] == "models":
        cls = ModelSettings
    else:
        return ()
    return tuple(f.name for f in dataclasses.fields(cls))


def _line(error: ErrorDetails) -> str:
    """One error as `PATH: problem`."""
    loc = error["loc"]
    if error["type"] == "config_line":
        return _message(error)
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
        parent, key = loc[:-1], loc[-1]
        known = _known_keys(parent)
        listed = f" (known: {', '.join(known)})" if known else ""
        return f"{_path(parent) or 'config'}: unknown key {key!r}{listed}"
    return f"{_path(loc) or 'config'}: {_message(error)}"


def _as_written(error: ErrorDetails, written: Mapping[str, str]) -> ErrorDetails:
    """The error with its section named as the file wrote it (a renamed key's old name)."""
    loc = error["loc"]
    if not loc or loc[0] not in written:
        return error
    shown = error.copy()
    shown["loc"] = (written[str(loc[0])], *loc[1:])
    return shown


def _one_line(exc: ValidationError, written: Mapping[str, str] | None = None) -> str:
    """The first problem (`written`: new section name -> the old one the file used)."""
    errors = [_as_written(e, written or {}) for e in exc.errors(include_url=False)]
    more = len(errors) - 1
    if more:  # still one line: the others show once this one is fixed
        return f"{_line(errors[0])} (and {more} more problem{'s' if more > 1 else ''})"
    return _line(errors[0])


# -- worker URLs and worker lists (a file source's) -------------------------------------

_WORKER: TypeAdapter[WorkerSpec] = TypeAdapter(WorkerEntry)


def parse_worker_url(url: str) -> WorkerSpec:
    """`grpc://HOST:PORT?model=M&runtime=sglang|vllm&role=...&bootstrap_port=N`."""
    if len(url) > MAX_URL:
        raise ConfigError(f"worker URL longer than {MAX_URL} characters")
    try:
        return _WORKER.validate_python(url)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "worker_url":
            message = str((error.get("ctx") or {})["problem"])
        else:
            message = _message(error)
        raise ConfigError(f"worker {url!r}: {message}") from None


_WORKERS: TypeAdapter[tuple[WorkerSpec, ...]] = TypeAdapter(tuple[WorkerEntry, ...])


def parse_worker_list(data: Any) -> tuple[WorkerSpec, ...]:
    """A file source's workers: a YAML list of `workers:` entries (or a mapping with
    `workers:`). ConfigError names the first bad entry."""
    if isinstance(data, Mapping) and set(data) == {"workers"}:
        data = data["workers"]
    if data is None:
        return ()
    try:
        specs = _WORKERS.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    check_workers(specs)
    return specs


# -- renamed keys: the old name is still read, for one release ----------------------------

# Old key -> new key. A file that gives the old one is told so (`warn_renamed`), one that
# gives both is refused.
RENAMED = {"breaker": "outlier_detection"}


def renamed_keys(file_data: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The renamed keys the file still uses, by their old names."""
    return tuple(old for old in RENAMED if old in (file_data or {}))


def warn_renamed(file_data: Mapping[str, Any] | None) -> None:
    """One warning for each renamed key the file uses: call it once, when logging is set
    up (build_config runs before, and stays silent)."""
    for old in renamed_keys(file_data):
        log.warning("config_key_deprecated", key=old, use=RENAMED[old])


def _renamed(data: dict[str, Any]) -> dict[str, str]:
    """Move the renamed keys of the file's data (in place) to their new names. Returns new
    name -> old, so a problem is told by the key as the file wrote it."""
    written = {}
    for old in renamed_keys(data):
        new = RENAMED[old]
        if new in data:
            raise ConfigError(f"{old}: the old name of {new}, which is given too: give only {new}")
        data[new] = data.pop(old)
        written[new] = old
    return written


# -- putting it together -----------------------------------------------------------------

_GATEWAY = TypeAdapter(GatewayConfig)


def _merged(
    file_data: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The file's data with the flags written in (`section.key` into its section), so
    both go through the same validation. An empty section (`probe:`) is the defaults."""
    data = dict(file_data or {})
    for key in (*SECTIONS, "workers", "models"):
        if key in data and data[key] is None:
            del data[key]
    for key, value in (overrides or {}).items():
        if value is None:  # the flag was not given
            continue
        *sections, name = key.split(".")
        into = data
        for section in sections:  # `picker.tls.cert`: into picker, then its tls
            inner = into.get(section, {})
            if not isinstance(inner, Mapping):
                break  # not a mapping, which validation reports
            into[section] = dict(inner)
            into = into[section]
        else:
            into[name] = value
    models = data.get("models")
    policy = data.get("default_policy", "round_robin")
    if isinstance(models, Mapping) and isinstance(policy, str) and policy in policy_names():
        data["models"] = {name: _inherit(settings, policy) for name, settings in models.items()}
    return data


def _inherit(settings: Any, policy: str) -> Any:
    """A model's settings with the default policy where they name none (`m:` alone too)."""
    if settings is None:
        settings = {}
    if isinstance(settings, Mapping) and "policy" not in settings:
        return {"policy": policy, **settings}
    return settings


def _check_addresses(config: GatewayConfig) -> None:
    """HOST:PORT where the gateway listens, and no open admin port without a token."""
    listens = [("listen", config.listen), ("admin.listen", config.admin.listen)]
    if config.metrics.listen is not None:
        listens.append(("metrics.listen", config.metrics.listen))
    picker = config.picker
    for path, text in (
        ("picker.listen", picker.listen),
        ("picker.relay_address", picker.relay_address),
    ):
        if text is not None:
            listens.append((path, text))
    for path, text in listens:
        if host_port(text) is None:
            raise ConfigError(f"{path}: {text!r} is not HOST:PORT")
    if picker.listen is not None and not picker.plaintext:
        picker_host, _ = parse_address(picker.listen, "picker.listen")
        if not is_loopback(picker_host) and not picker_tls(picker, config.tls).enabled:
            raise ConfigError(
                f"picker.listen: {picker.listen!r} is not loopback: serve the picker port "
                "with TLS (picker.tls, or the main port's tls), or set picker.plaintext: "
                "true where the network encrypts the hop (a service mesh's mTLS)"
            )
    admin_host, _ = parse_address(config.admin.listen, "admin.listen")
    if not config.admin.token and not is_loopback(admin_host):
        raise ConfigError(
            f"admin.listen: {config.admin.listen!r} is not loopback: give the admin "
            "API a token (admin.token, --admin-token-file or GATEWAY_ADMIN_TOKEN)"
        )


def build_config(
    file_data: Mapping[str, Any] | None = None,
    *,
    worker_urls: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Merge file, then flags (flags win), and validate everything."""
    data = dict(file_data or {})
    written = _renamed(data)
    try:
        config = _GATEWAY.validate_python(_merged(data, overrides))
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, written)) from None
    flagged = tuple(parse_worker_url(url) for url in worker_urls)
    if flagged:
        config = dataclasses.replace(config, workers=config.workers + flagged)
    _check_addresses(config)
    check_workers(config.workers)
    check_across(config)
    return config


def check_across(config: GatewayConfig) -> None:
    """The rules between sections: tenants' classes are flow classes, aliases send to
    models the config names (a reload's merged config is checked by them too)."""
    check_tenant_classes(config.flow, config.tenants)
    _check_routes(config)


def _check_routes(config: GatewayConfig) -> None:
    """Aliases (`models.<name>.route`) send only to models the config names."""
    problem = route_problem(routes_of(config.models), *route_targets(config))
    if problem is not None:
        where, message = problem
        raise ConfigError(f"{_path(('models', *where))}: {message}")
