"""/v1/models (vLLM's serving_models): the served model and each LoRA adapter, a model of its own whose parent is
the served model."""

from __future__ import annotations

from fastapi import APIRouter

from pipeline.serving.state import Shared

router = APIRouter()


@router.get("/v1/models")
async def models(gateway: Shared):
    base = {"id": gateway.served_name, "object": "model", "created": 0, "owned_by": "trtllm-pipeline"}
    return {
        "object": "list",
        "data": [base] + [{**base, "id": name, "parent": gateway.served_name} for name in gateway.adapters()],
    }
