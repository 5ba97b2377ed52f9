"""The `lora` section: PEFT LoRA adapters served over the base model, and the limits the engine is built with.

Names follow TensorRT-LLM's LoraConfig and vLLM's flags (max_lora_rank, max_loras, lora target modules), so a
config reads as either's; an adapter's `name` is the OpenAI `model` that selects it (vLLM's --lora-modules
name=path) and its `task_id` the Triton `lora_task_id` (TensorRT-LLM's).
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from pipeline.config.sections import Section
from pipeline.peft_adapters import LINEAR_MODULES


class LoraAdapterSection(Section):
    name: str = Field(
        description="The name that selects the adapter: the OpenAI `model` of a request and its /v1/models entry."
    )
    path: str = Field(
        description="PEFT adapter directory (adapter_config.json + adapter_model.safetensors); relative paths are "
        "relative to the config file."
    )
    task_id: int | None = Field(
        None,
        ge=1,
        description="Triton `lora_task_id` of the adapter (null: its position in the list, from 1); 0 means no "
        "adapter.",
    )

    @field_validator("name")
    @classmethod
    def _a_served_name(cls, name: str) -> str:
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"{name!r}: use letters, digits, '-', '_' and '.' (it is an OpenAI model name)")
        return name


class LoraSection(Section):
    adapters: list[LoraAdapterSection] = Field(
        [], description="Adapters loaded at start-up; more can be added while serving (gateway admin route)."
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank the engine takes (vLLM's default, 16).")
    max_loras: int = Field(
        4, ge=1, description="Adapters resident in the engine at once (one batch mixes at most this many)."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="Adapters registered at once, the build's and those added while serving (vLLM's and "
        "TensorRT-LLM's max_cpu_loras; each holds a host copy); null: max_loras. Loading one more is refused "
        "until one is unloaded, or evicted (evict_idle_adapters).",
    )
    evict_idle_adapters: bool = Field(
        False,
        description="When max_cpu_loras adapters are served, a load through the gateway unloads the adapter loaded "
        "while serving that it used least recently and is running no request (false: the load is refused).",
    )
    target_modules: list[str] = Field(
        list(LINEAR_MODULES),
        description="Linear modules the engine carries LoRA on (default: all seven, as vLLM does); an adapter may "
        "target any of them. Fewer cost less per step.",
    )

    @field_validator("target_modules")
    @classmethod
    def _linear_modules(cls, modules: list[str]) -> list[str]:
        unknown = [m for m in modules if m not in LINEAR_MODULES]
        if unknown or not modules:
            raise ValueError(
                f"{unknown or 'none'} are not linear modules of a decoder layer; use any of {list(LINEAR_MODULES)}"
            )
        return sorted(set(modules), key=LINEAR_MODULES.index)

    @model_validator(mode="after")
    def _distinct(self) -> "LoraSection":
        names = [a.name for a in self.adapters]
        ids = self.task_ids()
        if len(set(names)) < len(names):
            raise ValueError(f"adapter names repeat: {names}; each selects one adapter")
        if len(set(ids)) < len(ids):
            raise ValueError(f"adapter task ids repeat: {ids}; each selects one adapter")
        if self.max_cpu_loras is not None and self.max_cpu_loras < max(self.max_loras, len(self.adapters)):
            raise ValueError(
                f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras} or the "
                f"{len(self.adapters)} adapters listed; raise it to {max(self.max_loras, len(self.adapters))}"
            )
        return self

    def cpu_loras(self) -> int:
        """Adapters registered at once (max_cpu_loras, by default max_loras or the adapters listed, if more)."""
        return self.max_cpu_loras or max(self.max_loras, len(self.adapters))

    def task_ids(self) -> list[int]:
        return [a.task_id or position for position, a in enumerate(self.adapters, 1)]
