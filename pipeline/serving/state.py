"""What every route of one gateway shares (`Gateway`, on `app.state`), and the dependency that hands it to a route.

Every check a request passes before any work is done is here too: the model it names and the fields this server
cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from pipeline.serving.protocol import UNSUPPORTED, OpenAIError, Sampling
from pipeline.serving.upstream import Upstream


class Adapters(Protocol):
    """The LoRA adapters a gateway serves as models of their own: `AdapterAdmin` (in front of tritonserver, loaded
    and unloaded while serving) or `app.ServerAdapters` (those a server behind holds from the build)."""

    def served(self) -> dict[str, int]:
        """name -> task id (or position) of each adapter served now."""
        ...


@dataclass
class Gateway:
    """The served model (`served_name`, its tokenizer and the engine's limits: None leaves the check to the engine),
    the server behind the gateway, and the LoRA adapters served as models of their own (None: the base model only)."""

    served_name: str
    tokenizer: Any  # transformers' tokenizer, loaded by `create_app`
    upstream: Upstream
    lora: Adapters | None
    default_max_tokens: int
    max_input_len: int | None
    max_seq_len: int | None

    def adapters(self) -> dict[str, int]:
        """The adapters served now (name -> task id): the routes may add and remove them."""
        return self.lora.served() if self.lora is not None else {}

    def check(self, body: Sampling) -> None:
        """The model name and the fields this server cannot honour, before any work is done (on a worker thread:
        a large JSON schema takes a while to prepare)."""
        if body.model != self.served_name and body.model not in self.adapters():
            served = ", ".join(repr(name) for name in [self.served_name, *self.adapters()])
            raise OpenAIError(
                404,
                f"The model '{body.model}' does not exist; this server serves {served}",
                "not_found_error",
                "model",
            )
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, UNSUPPORTED[name], {}, []):
                raise OpenAIError(400, f"{name}: not supported by this server", param=name)
        body.constraint  # a format the engine cannot take fails here, before any work


def current(request: Request) -> Gateway:
    """The gateway of the app serving `request` (`create_app` puts it on `app.state`)."""
    return request.app.state.gateway


Shared = Annotated[Gateway, Depends(current)]  # a route's parameter: the gateway serving it
