"""The caller's principal: the client certificate's identity (mTLS), else the name of
the API key the call carried, else none. It scopes what a caller may touch: an Abort
reaches only requests its own principal started."""

from __future__ import annotations

from grpc import aio

from gateway.security.auth import ApiKeyAuth
from gateway.security.bearer import AUTHORIZATION, bearer
from gateway.security.keys import KeySource


class Identities:
    """Tells who a call comes from, where the gateway knows callers at all (client
    certificates or API keys); everyone is nobody otherwise, at no cost per call.

    `keys`: anything with `name_of` (an `ApiKeyAuth`, a `KeyFile`): asked on every call,
    so a reloaded file takes effect at once."""

    def __init__(self, keys: KeySource | None = None, certificates: bool = False) -> None:
        self._keys = keys
        self._certificates = certificates
        self.known = keys is not None or certificates
        # The API key authenticates the caller to the gateway: it never goes upstream.
        self.private_keys = frozenset({AUTHORIZATION}) if keys is not None else frozenset()

    async def identify(
        self, context: aio.ServicerContext, given: str | None, method: str
    ) -> str | None:
        """For a handler that authenticates its calls itself: with API keys on, the call
        must carry a known key (`given`: its bearer token) or it is refused; then its
        principal, the key looked up once."""
        name = None
        if isinstance(self._keys, ApiKeyAuth):
            name = await self._keys.authenticate(context, given, method)
        return self.principal(context, name)

    def principal(self, context: aio.ServicerContext, key_name: str | None = None) -> str | None:
        """The client certificate's name (mTLS), else the API key's name, else None.
        `key_name`: the key already authenticated for this call (then it is not looked
        up again)."""
        if not self.known:
            return None
        if self._certificates:
            auth = context.auth_context() or {}
            for field in ("x509_common_name", "x509_subject_alternative_name"):
                values = auth.get(field)
                if values:
                    return "cert:" + bytes(values[0]).decode(errors="replace")
        if key_name is None and self._keys is not None:
            key_name = self._keys.name_of(bearer(context.invocation_metadata()))
        return None if key_name is None else "key:" + key_name
