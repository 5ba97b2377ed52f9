"""/health, a load balancer's readiness probe: the one route that needs no API key (`pipeline.serving.guard`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

router = APIRouter()


@router.get("/health")
async def health():
    """200 once the model is ready (the Guard answers 503 before), as vLLM's /health; no API key needed."""
    return PlainTextResponse("ok")
