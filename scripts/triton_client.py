#!/usr/bin/env python
"""Call a served repository the three ways TensorRT-LLM deployments are called (works unchanged on GPU).

1. gRPC streaming through the ensemble (tritonclient.grpc), printing tokens as they arrive;
2. HTTP `/v2/models/ensemble/generate` (one JSON reply);
3. HTTP `/v2/models/ensemble/generate_stream` (server-sent events, one per token).

Start a server first (`trtllm-pipeline serve build_configs/smollm2-135m-cpu.yaml`), then:
    python scripts/triton_client.py "The capital of France is" --max-tokens 24
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from pipeline.triton.client import stream_text


def http_post(url: str, body: dict):
    return urllib.request.urlopen(
        urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}),
        timeout=300,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="ensemble", help="ensemble or tensorrt_llm_bls")
    parser.add_argument("--grpc", default="127.0.0.1:8001", help="gRPC address")
    parser.add_argument("--http", default="http://127.0.0.1:8000", help="HTTP base URL")
    args = parser.parse_args()

    print("== gRPC streaming ==")
    for chunk in stream_text(args.grpc, args.model, args.prompt, args.max_tokens):
        print(chunk, end="", flush=True)
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens}
    print("\n== HTTP generate ==")
    with http_post(f"{args.http}/v2/models/{args.model}/generate", body) as reply:
        print(json.loads(reply.read())["text_output"])
    print("== HTTP generate_stream ==")
    with http_post(f"{args.http}/v2/models/{args.model}/generate_stream", {**body, "stream": True}) as reply:
        for line in reply:
            if line.startswith(b"data: "):
                print(json.loads(line[6:])["text_output"], end="", flush=True)
    print()


if __name__ == "__main__":
    sys.exit(main())
