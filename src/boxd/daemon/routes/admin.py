"""Accounts and API keys; served on the local unix socket only."""

from __future__ import annotations

from fastapi import APIRouter

from boxd.daemon.routes.deps import KeysDep, LocalSocketOnly, StoreDep
from boxd.errors import InvalidInput
from boxd.models import Account, AccountSet, ApiKey, CreatedKey, KeyCreate, check_dns_label

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[LocalSocketOnly])


def _account_name(name: str, field: str) -> str:
    try:
        return check_dns_label(name, "an account name")
    except ValueError as error:
        raise InvalidInput(f"{field}: {error}", field=field) from None


@router.get("/accounts")
def list_accounts(store: StoreDep) -> list[Account]:
    return store.list_accounts()


@router.put("/accounts/{name}")
def set_account(name: str, body: AccountSet, store: StoreDep) -> Account:
    """Create the account or change its limit (``max_machines`` defaults to 50 when new)."""
    return store.set_account(_account_name(name, "name"), body.max_machines)


@router.post("/keys", status_code=201)
def create_key(body: KeyCreate, keys: KeysDep) -> CreatedKey:
    """A new key for an account; the answer holds the secret, which is never shown again."""
    return keys.mint(_account_name(body.account, "account"), body.name)


@router.get("/keys")
def list_keys(store: StoreDep) -> list[ApiKey]:
    return store.list_keys()


@router.delete("/keys/{key_id}")
def revoke_key(key_id: str, store: StoreDep) -> ApiKey:
    return store.revoke_key(key_id)
