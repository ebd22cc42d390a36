"""Signed ``/files`` URLs, as envd makes and checks them.

A signature is ``v1_`` and the unpadded base64 of the SHA-256 of
``path:operation:username:token``, with ``:expiration`` (Unix seconds) appended when the
URL expires; ``username`` is empty for the default user and ``token`` is the sandbox's
envd access token. A URL is refused once its expiration has passed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

READ = "read"
WRITE = "write"


def file_signature(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    fields = [path, operation, username, token] + ([] if expiration is None else [str(expiration)])
    digest = hashlib.sha256(":".join(fields).encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def signed_with(
    token: str, signature: str, *, path: str, operation: str, username: str, expiration: int | None
) -> bool:
    """Whether ``signature`` was made with ``token``, compared in constant time."""
    expected = file_signature(path, operation, username, token, expiration)
    return hmac.compare_digest(expected.encode(), signature.encode())


def expired(expiration: int | None) -> bool:
    return expiration is not None and expiration < int(time.time())  # whole seconds, as envd compares
