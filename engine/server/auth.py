"""Bearer API-key check for the /v1 routes (probes and /metrics stay open)."""

import hmac

from fastapi import Request

from engine.server.errors import Unauthorized


async def require_api_key(request: Request) -> None:
    expected = request.app.state.settings.api_key
    if expected is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), expected.encode()):
        raise Unauthorized(
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            headers={"WWW-Authenticate": "Bearer"},
        )
