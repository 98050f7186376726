"""TLS: the main port's certificates, reloaded without dropping a stream, and the
credentials for `grpcs://` workers."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import grpc
import structlog

from gateway.config import ConfigError, TlsConfig, UpstreamTlsConfig

log = structlog.get_logger("gateway.security.tls")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path!r}: {exc.strerror or exc}") from None


class CertificateFiles:
    """The main port's PEM files. grpc asks for them at every new handshake; they are
    read again when a file changed or after `reload()` (SIGHUP), so a renewed certificate
    takes effect for new connections while established ones keep theirs."""

    def __init__(self, config: TlsConfig) -> None:
        assert config.cert is not None and config.key is not None
        self._config = config
        self._paths = [p for p in (config.cert, config.key, config.client_ca) if p]
        self._lock = threading.Lock()  # grpc calls `fetch` from its own threads
        self._forced = False
        self._stamp = self._mtimes()
        self.initial = self._load()

    def _mtimes(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in self._paths)
        except OSError:
            return ()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        config = self._config
        assert config.cert is not None and config.key is not None
        key, cert = _read(config.key, "tls.key"), _read(config.cert, "tls.cert")
        roots = _read(config.client_ca, "tls.client_ca") if config.client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], roots)

    def reload(self) -> None:
        with self._lock:
            self._forced = True

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """New configuration if the files changed (or a reload was asked), else None."""
        with self._lock:
            stamp = self._mtimes()
            if stamp == self._stamp and not self._forced:
                return None
            self._stamp, self._forced = stamp, False
        try:
            loaded = self._load()
        except ConfigError as exc:  # keep serving with what works
            log.error("tls_reload_failed", error=str(exc))
            return None
        log.info("tls_reloaded", cert=self._config.cert)
        return loaded

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.initial,
            self.fetch,
            require_client_authentication=self._config.client_ca is not None,
        )


def channel_credentials(config: UpstreamTlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.ca, "upstream_tls.ca") if config.ca else None,
        private_key=_read(config.key, "upstream_tls.key") if config.key else None,
        certificate_chain=_read(config.cert, "upstream_tls.cert") if config.cert else None,
    )
