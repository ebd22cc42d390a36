"""The Python SDK: ``AsyncBoxd`` is the implementation, ``Boxd`` its synchronous face."""

from boxd.sdk.async_client import AsyncBoxd
from boxd.sdk.sync_client import Boxd

__all__ = ["AsyncBoxd", "Boxd"]
