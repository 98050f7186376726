"""Bearer-token check for the admin port: nothing served there (reflection included) is
reached without the token."""

from __future__ import annotations

import hmac

from gateway.security.bearer import BearerInterceptor

MISSING = "the admin API needs the metadata 'authorization: Bearer <token>'"
REJECTED = "the admin token was not accepted"


def admin_token_interceptor(token: str) -> BearerInterceptor:
    expected = token.encode()
    return BearerInterceptor(
        lambda given: hmac.compare_digest(given.encode(), expected), MISSING, REJECTED
    )
