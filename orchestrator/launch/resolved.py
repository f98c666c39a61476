"""One resolved launch: a recipe with what the user typed applied, parsed once, typed, immutable.

Built once per command (`resolve`) from the CLI's flags and the recipe's files, then handed to the checks, the
node previews, the dry run, the records and the backends. What a launch adds on the way (smoke artifacts, a --data
mount, the preemption hook, a personal bucket, the plan's prices) is applied with `replace`, never by editing a task.
Strings appear only at the edges: `env()` is what the nodes get (TRL_OVERRIDES rendered), `task()` the SkyPilot task
written to sky_jobs/ and sent, rendered last.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from orchestrator.core import configs, credentials, knobs, overrides, trl_schema
from orchestrator.core.accelerators import CPU, Gpus
from orchestrator.core.errors import OrchError, closest
from orchestrator.launch.recipe import Recipe

MAX_NODES = 16384
"""A bound on --nodes: torch's rendezvous and SkyPilot's gang scheduling are not made for more."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Launch:
    recipe: Recipe
    nodes: int
    """Number of nodes (the recipe's num_nodes, or --nodes)."""
    gpus: Gpus | None
    """Accelerators per node: a GPU type and count (cloud), CPU:N (local), None where the recipe names none."""
    envs: Mapping[str, str]
    """The task's envs: the recipe's, then --env; TRL_OVERRIDES is rendered from `overrides` by env()."""
    overrides: Mapping[str, str]
    """TRL key=value overrides: the recipe's TRL_OVERRIDES, then the user's words."""
    paired: configs.Configs
    """The Accelerate config, the TRL config file and the file accelerate will read."""
    secrets: tuple[str, ...] = ()
    """Names of the secrets the run gets (values never live here)."""
    resources: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """Extra SkyPilot resources fields orch sets (use_spot, network_tier)."""
    mounts: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    """SkyPilot file_mounts orch adds (a --data file: path on the nodes -> path here) or drops (None: a recipe's
    bucket on a Slurm cluster, which has no object store)."""
    hooks: tuple[Mapping[str, object], ...] = ()
    """Task-level config.hooks orch adds (the preemption hook of spot and managed launches)."""

    def __post_init__(self):
        for name in ("envs", "overrides", "resources", "mounts"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "hooks", tuple(MappingProxyType(copy.deepcopy(dict(h))) for h in self.hooks))

    @property
    def trainer(self) -> str:
        return self.envs["TRL_TRAINER"]

    @property
    def settings(self) -> Mapping[str, object]:
        """The TRL settings the script will see: the config file's, then the overrides."""
        return overrides.effective(self.paired.trl, self.overrides)

    def setting(self, key: str, default=None):
        value = self.settings.get(key)
        return default if value is None else value

    @property
    def evaluation(self) -> tuple[str, str] | None:
        """(eval_strategy, dataset_test_split) where TRL's scripts evaluate (an eval_strategy but `no`), else None."""
        strategy = overrides.eval_strategy(self.setting("eval_strategy"))
        return None if strategy is None else (strategy, str(self.setting("dataset_test_split", "test")))

    @property
    def gpus_per_node(self) -> int:
        """Processes per node: the accelerator count (CPU processes locally), 1 where the recipe names none."""
        return self.gpus.count if self.gpus else 1

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def replace(self, **changes) -> Launch:
        return dataclasses.replace(self, **changes)

    def env(self) -> dict[str, str]:
        """What the nodes get: the task's envs with TRL_OVERRIDES rendered (shell-quoted key=value words)."""
        out = dict(self.envs)
        if self.overrides or "TRL_OVERRIDES" in out:
            out["TRL_OVERRIDES"] = overrides.dumps(dict(self.overrides))
        return out

    def task(self, recipe_accelerators: bool = False) -> dict:
        """The SkyPilot task mapping (sky_jobs/<run>.yaml, sky.Task): secret names only, never values.

        recipe_accelerators: keep the recipe's resources.accelerators (a local run's record stays a cloud task)."""
        task = copy.deepcopy(self.recipe.task)
        task["num_nodes"] = self.nodes
        resources = dict(task.get("resources") or {})
        if self.gpus is not None and not recipe_accelerators:
            if self.gpus.name == CPU:  # CPU nodes (`--gpus none`): no accelerator to ask SkyPilot for
                resources.pop("accelerators", None)
            else:
                resources["accelerators"] = str(self.gpus)
        resources.update(self.resources)
        task["resources"] = resources
        task["envs"] = self.env()
        if self.secrets:
            task["secrets"] = {name: None for name in self.secrets}
        if self.mounts:
            mounts = {**(task.get("file_mounts") or {}), **self.mounts}
            task["file_mounts"] = {k: v for k, v in mounts.items() if v is not None}
            if not task["file_mounts"]:
                del task["file_mounts"]
        if self.hooks:
            config = dict(task.get("config") or {})
            config["hooks"] = [*(config.get("hooks") or []), *(copy.deepcopy(dict(h)) for h in self.hooks)]
            task["config"] = config
        return task


# `orch run` sends the recipe's `setup:` as the start of its `run:`: SkyPilot runs a setup stage as one more srun and
# executor start per node on Slurm (one more Ray task round on a cloud), measured 4.5-5 s of a 2-node launch on the
# bed, and it synchronises nothing orch needs (`orch node` passes its own barrier). In a subshell, so that the setup's
# `exit` and variables stay its own as in a stage of its own; with SkyPilot's setup-stage names set from the run's.
FOLD_HEAD = "# orch run: the recipe's setup, then its run, in one SkyPilot stage (docs/design.md, Time to first step)\n"
FOLD_ENV = (
    'export SKYPILOT_SETUP_NODE_RANK="$SKYPILOT_NODE_RANK" SKYPILOT_SETUP_NODE_IPS="$SKYPILOT_NODE_IPS" '
    'SKYPILOT_SETUP_NUM_GPUS_PER_NODE="$SKYPILOT_NUM_GPUS_PER_NODE"\n'
)


def fold_setup(task: dict) -> dict:
    """The task `orch run` sends: the recipe's `setup:` run on every node at the start of `run:`, which goes on only
    when it succeeds (its exit code otherwise; SkyPilot then fails the job and stops the other nodes: srun
    --kill-on-bad-exit on Slurm, the Ray driver's cancel on a cloud). A task without a setup is returned as it is."""
    setup = task.get("setup")
    if not setup or not str(setup).strip():
        return task
    folded = {k: v for k, v in task.items() if k != "setup"}
    run = str(task.get("run") or "")
    folded["run"] = f"{FOLD_HEAD}(\n{FOLD_ENV}{str(setup).rstrip()}\n) || exit $?\n{run}"
    return folded


def parse_env_assignments(words: Iterable[str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`--env K=V` values (`--env K` takes K from the caller's environment, as `sky launch --env` does)."""
    out: dict[str, str] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not _ENV_NAME.match(key):
            raise OrchError(f"--env {key!r}: not an environment variable name (letters, digits, _)")
        knobs.check_name(key, f"--env {key}")
        if why := knobs.set_by_launchers(key):
            raise OrchError(f"--env {key}: {why}; drop it")
        if not sep:
            if key not in environ:
                raise OrchError(f"--env {key}: {key} is not set here; give a value with --env {key}=VALUE")
            value = environ[key]
        if why := credentials.looks_secret(key, value):
            raise OrchError(f"--env {key}: {why}; --env values are written to sky_jobs/ and the task: pass it "
                            f"as --secret {key} (read from your environment, never written)")  # fmt: skip
        overrides.check_value(f"--env {key}=", value)
        out[key] = value
    return out


# the recipe variables orch reads that carry no ORCH_ prefix (node/plan.py's list, the cost estimate's, the bucket's)
READ_ENVS = ("TRL_TRAINER", "TRL_CONFIG", "ACCELERATE_CONFIG", "GLOBAL_BATCH_SIZE", "TRL_OVERRIDES",
             "MAIN_PROCESS_PORT", "VLLM_SERVER_NODES", "VLLM_SERVER_PORT", "CHECKPOINT_ROOT", "CHECKPOINT_BUCKET",
             "DDP_TIMEOUT", "EXPECTED_GPU_HOURS")  # fmt: skip


def env_notes(user_envs: Mapping[str, str], recipe: Recipe) -> list[str]:
    """A note for each --env name that neither orch nor the recipe reads but is one letter or word from one orch reads
    (GLOBAL_BATCH for GLOBAL_BATCH_SIZE): the task gets it, nothing uses it. A note, not a refusal: any other name
    may be the user's own code's."""
    notes = []
    for key in user_envs:
        if key in READ_ENVS or key in recipe.envs or key.startswith("ORCH_"):
            continue
        near = closest(key, READ_ENVS, cutoff=0.8)
        if near:
            notes.append(f"[orch] note: --env {key} is read by nothing orch or the recipe knows; did you mean {near}?")
    return notes


def resolve(
    recipe: Recipe,
    *,
    nodes: int | None = None,
    gpus: Gpus | None = None,
    envs: Mapping[str, str] | None = None,
    trl_overrides: Mapping[str, str] | None = None,
    secrets: Iterable[str] = (),
) -> Launch:
    """The recipe with the user's flags applied (they win): --nodes, --gpus (over the recipe's accelerators; a
    count alone keeps its type), --env, key=value. Reads the paired configs once."""
    if nodes is not None and nodes < 1:
        raise OrchError(f"--nodes {nodes}: a run needs at least 1 node")
    if nodes is not None and nodes > MAX_NODES:
        raise OrchError(f"--nodes {nodes}: orch launches at most {MAX_NODES} nodes in one run")
    task_envs = {**recipe.envs, **(envs or {})}
    for key, value in recipe.envs.items():  # a recipe is a file people share: no credential in it either
        knobs.check_name(key, f"{recipe.path}: envs.{key}")
        if why := knobs.set_by_launchers(key):
            raise OrchError(f"{recipe.path}: envs.{key}: {why}; drop it")
        if why := credentials.looks_secret(key, str(value)):
            raise OrchError(f"{recipe.path}: envs.{key}: {why}; move it to the recipe's `secrets:` as "
                            f"`{key}: null` and pass --secret {key} (never written)")  # fmt: skip
    trl_schema.check_trainer(task_envs.get("TRL_TRAINER", ""))
    merged = overrides.loads(task_envs.get("TRL_OVERRIDES", ""))
    merged.update(trl_overrides or {})
    return Launch(
        recipe=recipe,
        nodes=nodes or recipe.num_nodes,
        gpus=gpus if gpus and gpus.name else gpus.over(recipe.gpus) if gpus else recipe.gpus,  # --gpus H100:8 replaces
        envs=task_envs,
        overrides=merged,
        paired=configs.load(task_envs, recipe.workdir),
        secrets=tuple(secrets),
    )
