"""SkyPilot's own task schema, as data the launch side checks a recipe with before anything else reads it.

`sky_task_schema.json` beside this file is `sky.utils.schemas.get_task_schema()` of the installed SkyPilot, with what
SkyPilot validates later in place of its `{type: object}`: the resources schema and its aliases (gpus -> accelerators),
which Resources.from_yaml_config applies before validating, and each file mount's rule (a path, a volume, or a bucket
under the storage schema). `make snapshots` writes it from launch/backends/sky.task_schema_text(); a test fails when it
drifts. Importing SkyPilot costs ~1.5 s of CPU, which `orch ls` and every dry run would pay; jsonschema (SkyPilot's own
validator library) costs 0.1 s. The check is SkyPilot's `validate_schema`: None-valued fields skipped, envs and secrets
given as strings (as `Task.from_yaml` converts YAML numbers), SkyPilot's case-(in)sensitive enum keywords, and one line
naming the field. A task that passed is remembered by a hash of itself and of the schema
(ORCH_CACHE_DIR/sky-schema/<hash>), so `orch ls` over unchanged recipes does not import jsonschema at all (0.06 s of its
0.12 s); a changed task or schema is checked again, and a failed check is never remembered.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from orchestrator.core import home
from orchestrator.core.errors import OrchError, did_you_mean

SCHEMA = Path(__file__).parent / "sky_task_schema.json"


@cache
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def resources(resources: Mapping, where: str) -> dict:
    """The resources mapping as Resources.from_yaml_config validates it: None-valued fields skipped, and each alias
    renamed to its field, at the top and in every `any_of` / `ordered` entry (both spellings at once is its error)."""
    aliases = schema().get("x-resource-aliases", {})

    def renamed(entry):
        if not isinstance(entry, dict):
            return entry
        entry = dict(entry)
        for alias, field in aliases.items():
            if alias in entry:
                if field in entry:
                    raise OrchError(f"{where}: resources: set {field} or its alias {alias}, not both (SkyPilot refuses "
                                    "both)")  # fmt: skip
                entry[field] = entry.pop(alias)
        return entry

    out = renamed({k: v for k, v in resources.items() if v is not None})
    for key in ("any_of", "ordered"):
        if isinstance(out.get(key), list):
            out[key] = [renamed(entry) for entry in out[key]]
    return out


@cache
def _schema_digest() -> bytes:
    return hashlib.sha256(SCHEMA.read_bytes()).digest()


def _passed(config: Mapping) -> Path | None:
    """Where a pass of this exact task under this exact schema is remembered: JSON types kept apart (1, 1.0, "1" and
    true hash differently; a YAML date or other non-JSON value by its type and repr). None where the task cannot be
    written canonically (keys of mixed types): it is then checked every time."""
    try:
        text = json.dumps(config, sort_keys=True, default=lambda o: f"{type(o).__qualname__}:{o!r}")
    except (TypeError, ValueError):
        return None
    digest = hashlib.sha256(_schema_digest() + text.encode()).hexdigest()
    return home.cache_dir() / "sky-schema" / digest


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
    if isinstance(config.get("resources"), dict):
        config["resources"] = resources(config["resources"], where)
    passed = _passed(config)
    if passed is not None and passed.is_file():
        return
    errors = sorted(_validator().iter_errors(config), key=lambda e: (len(e.absolute_path), e.message))
    if not errors:
        if passed is not None:
            with contextlib.suppress(OSError):  # a read-only or full cache only costs the next call the check
                passed.parent.mkdir(parents=True, exist_ok=True)
                passed.touch()
        return
    error = errors[0]
    field = ".".join(str(p) for p in error.absolute_path) or "the task"
    known = list(error.schema.get("properties", {})) if isinstance(error.schema, dict) else []
    if error.validator == "additionalProperties" and isinstance(error.instance, dict) and known:
        unknown = [str(k) for k in error.instance if k not in known]
        hint = did_you_mean(unknown[0], known, cutoff=0.6) if unknown else ""
        what = {(): "task", ("resources",): "resources", ("file_mounts",): "storage"}.get(
            tuple(error.absolute_path)[:1], field)
        inside = f"{field}: " if error.absolute_path else ""
        raise OrchError(f"{where}: {inside}{unknown[0] if unknown else 'a field'!r} is not a SkyPilot {what} field; "
                        f"{hint}see SkyPilot's task YAML reference")  # fmt: skip
    raise OrchError(f"{where}: {field}: {error.message[:200]} (SkyPilot's task schema); fix the file")
