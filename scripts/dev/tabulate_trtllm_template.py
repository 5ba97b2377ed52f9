"""Tabulate the interface of tensorrtllm_backend's `tensorrt_llm/config.pbtxt` template as JSON facts.

Maintainer tool, not run by the pipeline: it turns the real template of one TensorRT-LLM release into
`pipeline/triton/tensorrt_llm_templates.json` (tensor names, types, dims, flags and parameter keys),
which the `trtllm` target's repository generator fills from the build config. Usage:
    git -C tensorrtllm_backend show v0.19.0:all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt > t.pbtxt
    python scripts/dev/tabulate_trtllm_template.py t.pbtxt 0.19 pipeline/triton/tensorrt_llm_templates.json
"""

import json
import re
import sys
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


def tabulate(text: str) -> dict:
    # data types that are template variables keep the variable's name, e.g. "${logits_datatype}"
    typed = {
        name: "${" + variable + "}"
        for name, variable in re.findall(r'name:\s*"(\w+)"\s*data_type:\s*\$\{(\w+)\}', text)
    }
    config = mc.ModelConfig()
    text_format.Parse(PLACEHOLDER.sub("1", re.sub(r"data_type:\s*\$\{\w+\}", "data_type: TYPE_FP32", text)), config)

    def tensor(t, is_input):
        row = {"name": t.name, "data_type": typed.get(t.name, mc.DataType.Name(t.data_type)), "dims": list(t.dims)}
        if is_input:
            row |= {"optional": t.optional, "allow_ragged_batch": t.allow_ragged_batch}
        if t.HasField("reshape"):
            row["reshape"] = list(t.reshape.shape)
        return row

    return {
        "inputs": [tensor(t, True) for t in config.input],
        "outputs": [tensor(t, False) for t in config.output],
        "parameters": list(config.parameters),
    }


if __name__ == "__main__":
    template, version, out = sys.argv[1:4]
    table = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    table[version] = tabulate(Path(template).read_text())
    Path(out).write_text(json.dumps(table, indent=1) + "\n")
