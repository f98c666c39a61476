"""SkyPilot's own task schema, as data the launch side checks a recipe with before anything else reads it.

`sky_task_schema.json` beside this file is `sky.utils.schemas.get_task_schema()` of the installed SkyPilot
(`make snapshots`: launch/backends/sky.write_task_schema; a test fails when it drifts). Importing SkyPilot costs
~1.5 s of CPU, which `orch ls` and every dry run would pay; jsonschema (SkyPilot's own validator library) costs
0.1 s. The check is SkyPilot's `validate_schema`: None-valued fields skipped, envs and secrets given as strings (as
`Task.from_yaml` converts YAML numbers), SkyPilot's case-(in)sensitive enum keywords, and one line naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.core.errors import OrchError, did_you_mean

SCHEMA = Path(__file__).parent / "sky_task_schema.json"


@cache
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


@cache
def _validator():
    import jsonschema

    def enum(case: bool):
        def check(validator, enums, instance, schema):
            text = instance if case else str(instance).lower()
            if text not in (enums if case else [e.lower() for e in enums]):
                yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

        return check

    cls = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={
        "case_insensitive_enum": enum(False), "case_sensitive_enum": enum(True)})  # fmt: skip
    return cls(schema())


def check_task(task: Mapping, where: str) -> None:
    """A recipe's task against SkyPilot's schema: the first error as one OrchError line."""
    config = {k: v for k, v in task.items() if v is not None}
    for key in ("envs", "secrets"):
        if isinstance(config.get(key), dict):
            config[key] = {str(k): None if v is None else str(v) for k, v in config[key].items()}
    errors = sorted(_validator().iter_errors(config), key=lambda e: (len(e.absolute_path), e.message))
    if errors:
        error = errors[0]
        field = ".".join(str(p) for p in error.absolute_path) or "the task"
        if error.validator == "additionalProperties" and not error.absolute_path:
            known = list(schema().get("properties", {}))
            unknown = [k for k in config if k not in known]
            hint = did_you_mean(unknown[0], known, cutoff=0.6) if unknown else ""
            raise OrchError(f"{where}: {unknown[0] if unknown else 'a field'!r} is not a SkyPilot task field; "
                            f"{hint}see SkyPilot's task YAML reference")  # fmt: skip
        raise OrchError(f"{where}: {field}: {error.message[:200]} (SkyPilot's task schema); fix the file")
