"""API keys: minting, checking, and the local key of the embedded daemon.

A key is ``boxd_`` + 48 hex digits. Its first 12 digits are its id (the lookup column,
shown by ``boxd keys list``); only the SHA-256 of the whole key is stored, so a leaked
database does not leak keys. The E2B API also takes a key spelled ``e2b_`` + the same hex
digits: e2b 2.25 to 2.45 refuse, before sending, any key that is not "e2b_" + hex.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from boxd.daemon.store import Store
from boxd.errors import AuthError
from boxd.models import CreatedKey

KEY_PREFIX = "boxd_"
E2B_KEY_PREFIX = "e2b_"
_KEY = re.compile(r"^boxd_([0-9a-f]{12})[0-9a-f]{36}$")
LOCAL_ACCOUNT = "local"


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def boxd_spelling(key: str) -> str:
    """A key as boxd stores it, whichever of its two spellings it came in."""
    return KEY_PREFIX + key.removeprefix(E2B_KEY_PREFIX) if key.startswith(E2B_KEY_PREFIX) else key


class Keys:
    def __init__(self, store: Store) -> None:
        self._store = store

    def mint(self, account: str, name: str | None = None, *, machine: str | None = None) -> CreatedKey:
        """A new key of ``account``; one for a ``machine`` replaces its previous one and
        is revoked when the machine is deleted."""
        key = KEY_PREFIX + secrets.token_hex(24)
        key_id = key[len(KEY_PREFIX) : len(KEY_PREFIX) + 12]
        record = self._store.add_key(key_id, account, name, _sha256(key), machine=machine)
        return CreatedKey(**record.model_dump(), key=key)

    @staticmethod
    def is_boxd_key(authorization: str | None) -> bool:
        """Whether an Authorization header carries a boxd key (and not a machine app's own)."""
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and key.strip().startswith(KEY_PREFIX)

    def account_of(self, authorization: str | None) -> str:
        """The account an ``Authorization: Bearer`` header belongs to; AuthError if none."""
        if not authorization:
            raise AuthError("missing API key: send Authorization: Bearer <key> (the SDK reads BOXD_API_KEY)")
        scheme, _, key = authorization.partition(" ")
        match = _KEY.match(key.strip())
        if scheme.lower() != "bearer" or match is None:
            raise AuthError("malformed API key: expected Authorization: Bearer boxd_<key>")
        found = self._store.key_secret(match.group(1))
        if found is None or not hmac.compare_digest(found[1], _sha256(key.strip())):
            raise AuthError("unknown or revoked API key")
        return found[0]

    def ensure_local_key(self, path: Path) -> None:
        """Make sure ``path`` holds a working key of the local account (mode 600).

        The embedded SDK reads it when it talks to this daemon over its unix socket.
        """
        self._store.set_account(LOCAL_ACCOUNT, None)
        try:
            self.account_of("Bearer " + path.read_text().strip())
            return
        except (FileNotFoundError, AuthError):
            pass
        created = self.mint(LOCAL_ACCOUNT, name="local key")
        partial = path.with_name(path.name + ".part")
        partial.unlink(missing_ok=True)
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(created.key + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
