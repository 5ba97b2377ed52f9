"""The build config: one typed pydantic model (`BuildConfig`), loaded once from YAML (`pipeline.validation.load_config`,
which adds its target's rules); every stage reads only this. A leaf: it imports no target, stage or serving module.

Modules: `sections` (the build sections), `lora_section`, `deploy` (the deploy section), `schema` (BuildConfig and
the views the CLI prints), `loading` (YAML, overrides, line-numbered errors) and `cross_field` (the rules that span
fields).
"""

from pipeline.config.deploy import DeploySection
from pipeline.config.schema import BuildConfig, dump_value, leaf_field_paths, resolved_yaml
from pipeline.config.sections import BuildSection, CalibrationSection, GptqSection, SmoothQuantSection

__all__ = [
    "BuildConfig",
    "BuildSection",
    "CalibrationSection",
    "DeploySection",
    "GptqSection",
    "SmoothQuantSection",
    "dump_value",
    "leaf_field_paths",
    "resolved_yaml",
]
