"""`discovery:`: sources of workers (DNS, Kubernetes, a file), each feeding the fleet's
one door."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, Strict, model_validator
from pydantic.dataclasses import dataclass

from gateway.config.addresses import host_port
from gateway.config.errors import field_error, show
from gateway.config.fields import (
    SETTINGS,
    AtLeastOne,
    Flag,
    Interval,
    ModelName,
    Name,
    Port,
    Seconds,
    Text,
)
from gateway.core.roles import Role, Runtime

# -- discovery: sources of workers, each feeding the fleet's one door -----------------------


def _host_and_port(text: str) -> str:
    if host_port(text) is None:
        raise field_error(f"{text!r} is not HOST:PORT")
    return text


def _label_or_annotation(text: str) -> str:
    kind, _, key = text.partition(":")
    if kind not in ("label", "annotation") or not key:
        raise field_error(f"{text!r} must be label:KEY or annotation:KEY")
    return text


def _container_port(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise field_error(f"must be a port number or a container port name, not {show(value)}")
    if isinstance(value, int) and not 1 <= value <= 65535:
        raise field_error(f"must be a port number from 1 to 65535, not {value}")
    if isinstance(value, str) and not value:
        raise field_error("must not be empty")
    return value


DISCOVERY_TAGS = ("dns", "kubernetes", "file")
HostPort = Annotated[str, Strict(), AfterValidator(_host_and_port)]
PodField = Annotated[str, Strict(), AfterValidator(_label_or_annotation)]
ContainerPort = Annotated[int | str, BeforeValidator(_container_port)]


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DnsDiscovery:
    """Workers at the addresses `name` resolves to: its A/AAAA records with `port`, or
    (no port) its SRV records, each naming a host and its port. Resolved again every
    `interval_s`, sooner when the records' TTL is shorter, never faster than 1 s. An
    answer with more than `max_hosts` hosts (or SRV records) is refused: the last stay."""

    source: Literal["dns"]
    name: Name = Field(description="the name to resolve")
    port: Port | None = Field(
        default=None, description="the workers' port, with A/AAAA records; absent: SRV records"
    )
    nameserver: HostPort | None = Field(
        default=None, description="the resolver to ask; null: the system's"
    )
    interval_s: Annotated[float, Strict(), Field(ge=1)] = Field(
        default=5.0,
        description="resolve again this often (sooner when the records' TTL is shorter)",
    )
    model: ModelName | None = Field(
        default=None, description="as a URL's `model`; null: asked from each worker"
    )
    runtime: Runtime | None = Field(default=None, description="as a URL's `runtime`")
    role: Role | None = Field(default=None, description="as a URL's `role`")
    tls: Flag = Field(
        default=False, description="reach the workers over TLS (`grpcs://`, with `upstream_tls`)"
    )
    max_hosts: AtLeastOne = Field(
        default=256, description="a larger answer is refused whole; the last hosts stay"
    )

    @property
    def label(self) -> str:
        return f"dns:{self.name}"


@dataclass(frozen=True, slots=True, config=SETTINGS)
class KubernetesDiscovery:
    """Workers that are the Pods `selector` matches in `namespace`, at their container
    port `port` (a name or a number). A Pod is in service while Running, Ready and not
    terminating; out of service longer than `unready_grace_s`, it leaves. A list of more
    than `max_hosts` hosts is refused: the last stay."""

    source: Literal["kubernetes"]
    port: ContainerPort = Field(description="the Pods' container port, by name or number")
    selector: Text = Field(default="", description="label selector of the Pods; empty: every Pod")
    namespace: Name | None = Field(
        default=None, description="null: the pod's own (in cluster), else kubeconfig's"
    )
    model: ModelName | None = Field(
        default=None, description="as a URL's `model` (or `model_from`)"
    )
    # label:KEY or annotation:KEY, instead of model
    model_from: PodField | None = Field(
        default=None, description="the model from a Pod label or annotation"
    )
    runtime: Runtime | None = Field(default=None, description="as a URL's `runtime`")
    role: Role | None = Field(default=None, description="as a URL's `role`")
    tls: Flag = Field(default=False, description="reach the Pods over TLS (`grpcs://`)")
    bootstrap_port_annotation: Name | None = Field(
        default=None, description="SGLang PD: the annotation holding a prefill's bootstrap port"
    )
    unready_grace_s: Seconds = Field(
        default=30.0, description="a Pod out of service this long leaves the fleet"
    )
    resync_s: Interval = Field(
        default=60.0, description="list the Pods again this often, whatever the watch said"
    )
    kubeconfig: Name | None = Field(
        default=None,
        description="null: in-cluster credentials, else $KUBECONFIG or ~/.kube/config",
    )
    max_hosts: AtLeastOne = Field(
        default=256, description="a larger set of Pods is refused whole; the last stay"
    )

    @property
    def label(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""  # none: the client's own
        return f"kubernetes:{where}{self.selector or '*'}"

    @model_validator(mode="after")
    def _one_model(self) -> KubernetesDiscovery:
        if self.model is not None and self.model_from is not None:
            raise field_error("give model or model_from, not both")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FileDiscovery:
    """Workers listed in a YAML file (a list of worker URLs or `workers:` entries),
    read again when it changes (checked every `interval_s`). A file of more than
    `max_hosts` hosts, or larger than 256 bytes a host (64 KiB by default), is refused:
    the last hosts stay."""

    source: Literal["file"]
    path: Name = Field(description="a YAML list of worker URLs (or `workers:` entries)")
    interval_s: Interval = Field(
        default=1.0, description="how often the file is checked for a change"
    )
    max_hosts: AtLeastOne = Field(
        default=256, description="more entries (or over 256 bytes an entry) are refused"
    )

    @property
    def label(self) -> str:
        return f"file:{self.path}"


DiscoverySource = Annotated[
    DnsDiscovery | KubernetesDiscovery | FileDiscovery, Field(discriminator="source")
]
