"""API keys: with keys configured, every /v1 route needs ``Authorization: Bearer <key>`` (checked before the body
is read: a request without a valid key is 401, never 400 or 404); health routes and /metrics stay open. Each key is
an owner: files and batches belong to the key that created them, and its requests get their own prefix-cache salt
(a cache hit shows in the time to first token, which would tell one tenant what another's prompts start with).

Keys are compared by their SHA-256 digests in constant time and never logged; the owner id is a digest prefix."""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEYS_ENV = "TRITON_LLM_API_KEYS"  # comma-separated; never OPENAI_API_KEY, which users export for OpenAI itself
KEYS_FILE_ENV = "TRITON_LLM_API_KEYS_FILE"  # a file of keys (comma- or newline-separated): a mounted Secret


def owner_of(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def parse_keys(text: str | None) -> tuple[str, ...]:
    return tuple(k.strip() for k in (text or "").replace("\n", ",").split(",") if k.strip())


def keys_from_environment(environ) -> tuple[str, ...]:
    """$TRITON_LLM_API_KEYS, and the keys in the file $TRITON_LLM_API_KEYS_FILE names when it exists (an optional
    Secret that was not created leaves no file: then no keys from it)."""
    keys = parse_keys(environ.get(KEYS_ENV))
    path = environ.get(KEYS_FILE_ENV)
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            keys += parse_keys(file.read())
    return keys


def tenant_salt(owner: str, given: str | None) -> str:
    """The prefix-cache salt of a request: the owner's own, joined with (a digest of) the request's cache_salt if
    it gave one, so the result stays within the server's 256 bytes."""
    if not owner:
        return given or ""
    return f"{owner}:{hashlib.sha256(given.encode('utf-8')).hexdigest()[:32]}" if given else owner


class ApiKeyMiddleware:
    """Pure ASGI, so nothing reads the body before the key is checked. Sets scope["state"]["owner"]."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self._digests = {hashlib.sha256(k.encode("utf-8")).digest(): owner_of(k) for k in keys}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            owner = ""
            if self._digests and scope["path"].startswith("/v1"):
                owner = self._owner(dict(scope["headers"]).get(b"authorization", b""))
                if owner is None:
                    await _unauthorized(send)
                    return
            scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)

    def _owner(self, header: bytes) -> str | None:
        scheme, _, key = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode("utf-8")).digest()
        found = None
        for known, owner in self._digests.items():  # every digest compared, in constant time
            if hmac.compare_digest(known, digest):
                found = owner
        return found


async def _unauthorized(send) -> None:
    body = json.dumps({"error": {
        "message": "Incorrect API key provided. Send a valid key as 'Authorization: Bearer <key>'.",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
