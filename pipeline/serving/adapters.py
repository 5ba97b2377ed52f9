"""vLLM's LoRA admin routes, /v1/load_lora_adapter and /v1/unload_lora_adapter, served only where the engine
carries LoRA; what they may do is `pipeline.serving.adapter_admin`'s to decide."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pipeline.serving.protocol import LoadLoraAdapter, OpenAIError, UnloadLoraAdapter
from pipeline.serving.state import Shared

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapter, gateway: Shared):
    """vLLM's route: serve the PEFT adapter in `lora_path` (in a directory `serve --allow-lora-dir` allows) as
    model `lora_name` from now on, until it is unloaded or the server stops."""
    if body.lora_name == gateway.served_name:
        raise OpenAIError(400, f"the model '{body.lora_name}' is already served", param="lora_name")
    try:
        await asyncio.to_thread(gateway.lora.add, body.lora_name, body.lora_path)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapter, gateway: Shared):
    """vLLM's route: stop serving an adapter loaded while serving (requests running on it finish)."""
    try:
        await asyncio.to_thread(gateway.lora.remove, body.lora_name)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
