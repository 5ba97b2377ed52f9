"""The OpenAI-compatible serving tier in front of tritonserver, or of a target's own server (trtllm-serve).

Shaped like vLLM's `entrypoints/openai/`:

- `app`: `create_app`, the gateway assembled (vLLM's api_server), and its error handlers
- `guard`: the door before any route: API key, body-size cap, readiness
- `state`: what the routes share (`Gateway`, on `app.state`) and the checks every request passes first
- `upstream`: the server behind the gateway as routes see it (`Upstream`), and tritonserver's BLS as one
- `openai_upstream`: an OpenAI-compatible HTTP server as one (trtllm-serve, in the dialect its target supplies)
- `responses`: one generation answered whole or streamed, shared by chat and completions (vLLM's serving_engine)
- `stops`: stop strings cut from the text by the gateway
- `chat`, `completions`, `models`: /v1/chat/completions, /v1/completions, /v1/models (vLLM's serving_chat,
  serving_completion, serving_models)
- `adapters`: the LoRA admin routes; `adapter_admin`: what they may do, and the registry they write
- `health`: /health
- `protocol`: the request and error shapes, and the guided-decoding guide a request asks for
- `lifecycle`: a served repository's start and stop, as `serve` runs it
"""
