"""The build config: one typed pydantic model (`BuildConfig`), loaded once from YAML (`load_config`); every stage
reads only this.

Modules: `sections` (the build sections), `deploy` (the deploy section), `schema` (BuildConfig and the views the CLI
prints), `loading` (YAML, overrides, line-numbered errors) and `cross_field` (the rules that span fields).
"""

from pipeline.config.deploy import DeploySection
from pipeline.config.loading import load_config
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
    "load_config",
    "resolved_yaml",
]
