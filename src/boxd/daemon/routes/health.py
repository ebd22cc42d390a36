from __future__ import annotations

from fastapi import APIRouter

from boxd import __version__
from boxd.models import Health

router = APIRouter(tags=["health"])


@router.get("/v1/health")
def health() -> Health:
    """Answers without a key: the SDK asks it to know a daemon is up."""
    return Health(version=__version__)
