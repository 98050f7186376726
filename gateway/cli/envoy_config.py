"""`gateway envoy-config`: the bootstrap of an Envoy that relays the calls itself with the
gateway as its endpoint picker, printed as YAML from flags alone (it reads no gateway
configuration)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.config import DESTINATION_HEADER
from gateway.config.addresses import host_port
from gateway.config.picker import MAX_BODY_BYTES

if TYPE_CHECKING:
    from gateway.picker.envoy import PickerTls


ENVOY_CONFIG_DESCRIPTION = """\
Print, as YAML, the bootstrap of an Envoy that relays the calls itself with the gateway
as its endpoint picker (`gateway serve --picker-listen HOST:PORT`): one listener whose
calls pass Envoy's external processing filter (the picker places each one, or answers it
as the relay would), then go to the worker the picker named (an original destination
cluster that reads the address from the picker's header); a Lua filter hands the picker
the last message of each answer it placed (its token counts); Envoy health-checks the
picker. Run it with `envoy -c FILE`. It reads no gateway configuration: give the flags
that match it (--picker: where picker.listen is reached, --header: picker.header)."""

ENVOY_CONFIG_EPILOG = """\
--message-timeout-s bounds each answer of the picker, and a call waits in its model's
queue (flow control) before the picker answers its request: make it at least the longest
flow.classes[].ttl_s (the default, 330 s, covers the default batch class's 300 s), or
those calls fail at Envoy instead of waiting their turn.

exit status:
  0  the configuration is on stdout
  2  a usage error (a bad flag), told on stderr
"""

ENVOY_DEFAULTS = {
    "listen": "0.0.0.0:8080",
    "picker": "127.0.0.1:9002",
    "admin": "127.0.0.1:9901",
    "header": DESTINATION_HEADER,
    "message_timeout_s": 330.0,
    "max_body_bytes": MAX_BODY_BYTES,
}
METADATA_KEY = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")  # gRPC's, lowercase
# Envoy reads a duration; the picker's answer to a queued call may take this long.
MESSAGE_TIMEOUT_S = (0.001, 86_400.0)


def _host_port(text: str) -> str:
    """A HOST:PORT flag, checked as the gateway's own addresses are."""
    if host_port(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _admin_address(text: str) -> str | None:
    return None if text == "off" else _host_port(text)


def _header_name(text: str) -> str:
    """A header Envoy and gRPC both carry as it is: a gRPC metadata key."""
    name = text.lower()
    if not name or not set(name) <= METADATA_KEY:
        raise argparse.ArgumentTypeError(f"{text!r} is not a header name (a-z 0-9 - _ .)")
    return name


def _message_timeout(text: str) -> float:
    low, high = MESSAGE_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not low <= seconds <= high:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds from {low:g} to {high:g}")
    return seconds


def _envoy_config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway envoy-config",
        description=ENVOY_CONFIG_DESCRIPTION,
        epilog=ENVOY_CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(**ENVOY_DEFAULTS)
    add = parser.add_argument
    add(
        "--listen",
        metavar="HOST:PORT",
        type=_host_port,
        help=f"where Envoy listens for clients (default {ENVOY_DEFAULTS['listen']})",
    )
    add(
        "--picker",
        metavar="HOST:PORT",
        type=_host_port,
        help="where Envoy reaches the gateway's picker port (gateway serve "
        f"--picker-listen; default {ENVOY_DEFAULTS['picker']})",
    )
    add(
        "--admin",
        metavar="HOST:PORT|off",
        type=_admin_address,
        help=f"Envoy's admin port, or none (default {ENVOY_DEFAULTS['admin']})",
    )
    add(
        "--header",
        metavar="NAME",
        type=_header_name,
        help=f"the header the picker names the worker in: picker.header (default "
        f"{DESTINATION_HEADER})",
    )
    add(
        "--message-timeout-s",
        metavar="S",
        type=_message_timeout,
        help="how long Envoy waits for each answer of the picker (default "
        f"{ENVOY_DEFAULTS['message_timeout_s']:g})",
    )
    add(
        "--max-body-bytes",
        metavar="N",
        type=_positive,
        help="the most of a request Envoy buffers for the picker: picker.max_body_bytes "
        f"(default {MAX_BODY_BYTES})",
    )
    add(
        "--picker-ca",
        metavar="FILE",
        help="the picker port serves TLS: the CA that signed its certificate (as Envoy "
        "reads the file)",
    )
    add(
        "--picker-sni",
        metavar="NAME",
        help="the name the picker's certificate is checked for (default: --picker's host)",
    )
    add("--picker-cert", metavar="FILE", help="Envoy's client certificate for the picker (mTLS)")
    add("--picker-key", metavar="FILE", help="its private key")
    add(
        "--token-counts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the Lua filter that hands the picker the last message of each answer it "
        "placed, for the token counts of its calls (--no-token-counts: none, and Envoy "
        "does no work per message for it; default: on)",
    )
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def envoy_config_yaml(
    listen: str,
    picker: str,
    admin: str | None,
    header: str,
    message_timeout_s: float,
    max_body_bytes: int = MAX_BODY_BYTES,
    picker_tls: PickerTls | None = None,
    token_counts: bool = True,
) -> str:
    """`gateway envoy-config`'s output: the bootstrap, under a comment with the command
    that made it (a copy kept in a repository then says how to make it again)."""
    import yaml

    from gateway.picker.envoy import envoy_config

    bootstrap = envoy_config(
        listen,
        picker,
        admin=admin,
        header=header,
        message_timeout_s=message_timeout_s,
        max_body_bytes=max_body_bytes,
        picker_tls=picker_tls,
        token_counts=token_counts,
    )
    more = ""
    if picker_tls is not None:
        more = f" \\\n#     --picker-ca {picker_tls.ca}"
        if picker_tls.cert is not None:
            more += f" --picker-cert {picker_tls.cert} --picker-key {picker_tls.key}"
        if picker_tls.sni is not None:
            more += f" --picker-sni {picker_tls.sni}"
    if not token_counts:
        more += " \\\n#     --no-token-counts"
    head = (
        "# Envoy with the gateway as its endpoint picker, made by\n"
        f"#   gateway envoy-config --listen {listen} --picker {picker} --admin {admin or 'off'}"
        f" \\\n#     --header {header} --message-timeout-s {message_timeout_s:g}"
        f" --max-body-bytes {max_body_bytes}{more}\n"
        "# Run it with `envoy -c FILE`, the gateway with `gateway serve --picker-listen`.\n"
    )

    class Dumper(yaml.SafeDumper):
        """Text of several lines (the Lua filter's source) as a literal block: readable."""

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return head + yaml.dump(bootstrap, Dumper=Dumper, sort_keys=False)


def envoy_config(argv: Sequence[str]) -> int:
    """Run `gateway envoy-config ARGS`: the YAML on stdout, 0; a bad flag: exit 2."""
    parser = _envoy_config_parser()
    args = parser.parse_args(argv)
    from gateway.picker.envoy import PickerTls

    tls = None
    if args.picker_ca is not None:
        tls = PickerTls(args.picker_ca, args.picker_cert, args.picker_key, args.picker_sni)
    elif args.picker_cert or args.picker_key or args.picker_sni:
        parser.error("--picker-cert, --picker-key and --picker-sni need --picker-ca")
    if (args.picker_cert is None) != (args.picker_key is None):
        parser.error("--picker-cert and --picker-key go together")
    text = envoy_config_yaml(
        args.listen,
        args.picker,
        args.admin,
        args.header,
        args.message_timeout_s,
        args.max_body_bytes,
        tls,
        args.token_counts,
    )
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0
