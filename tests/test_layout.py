"""The launch side as one resolved launch, the rooms of the package and their import rules, the wheel."""

import ast
import re
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT, orch

from orchestrator.launch import recipe as recipes
from orchestrator.launch.resolved import resolve

pytestmark = pytest.mark.unit

PACKAGE = ROOT / "orchestrator"
HEAVY = {"torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "peft", "vllm", "sky", "tokenizers"}


# ---------------------------------------------------------------- the dry run's batch decomposition


@pytest.mark.parametrize(
    "flags, line",
    [
        ([], "batch: GLOBAL_BATCH_SIZE 32 = 1 per device x 4 data-parallel ranks x 8 accumulation steps"),
        (["--nodes", "2"], "batch: GLOBAL_BATCH_SIZE 32 = 1 per device x 8 data-parallel ranks x 4 accumulation steps"),
    ],
)
def test_context_parallel_dry_run_decomposition_multiplies_out(flags, line):
    """cp=2 halves the data-parallel ranks: 8 GPUs are 4 of them (the dry run used to print the GPU count)."""
    result = orch("run", "qwen3_sft_fsdp_cp", *flags, "--dry-run", "--skip-optimizer")
    assert result.returncode == 0, result.stderr
    assert line in result.stdout
    printed = re.search(
        r"GLOBAL_BATCH_SIZE (\d+) = (\d+) per device x (\d+) data-parallel ranks x (\d+)", result.stdout
    )
    total, per_device, ranks, steps = map(int, printed.groups())
    assert per_device * ranks * steps == total


# ---------------------------------------------------------------- the default recipe


def test_run_without_a_recipe_uses_the_repositorys_default_and_says_so():
    result = orch("run", "--gpus", "A100:8", "--nodes", "2", "--dry-run", "--skip-optimizer")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("[orch] recipe: phi3_dpo_fsdp (the project's default: [tool.orch] recipe in pyproject.toml")
    assert "[orch] dry run of phi3_dpo_fsdp" in result.stdout and "--num_processes 16" in result.stdout


def test_orch_recipe_env_and_a_key_value_first_word(project):
    result = orch(
        "run", "max_steps=3", "--dry-run", "--skip-optimizer", env={"ORCH_RECIPE": "qwen25_sft_ddp"}, cwd=project
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[orch] recipe: qwen25_sft_ddp (from ORCH_RECIPE;")
    assert "TRL_OVERRIDES: max_steps=3" in result.stdout
    bare = orch("run", "--dry-run", "--skip-optimizer", cwd=project)  # no pyproject.toml there
    assert bare.stdout.startswith("[orch] recipe: phi3_dpo_fsdp (orch's default recipe;"), bare.stderr


# ---------------------------------------------------------------- one resolved launch


def test_resolved_launch_is_typed_and_parsed_once(monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = recipes.load("phi3_dpo_fsdp")
    from orchestrator.core.accelerators import Gpus

    launch = resolve(recipe, nodes=2, gpus=Gpus(None, 4), trl_overrides={"beta": "0.2"}, secrets=["HF_TOKEN"])
    assert launch.gpus == Gpus("A100", 4)  # a count alone keeps the recipe's type
    assert launch.setting("beta") == "0.2" and launch.setting("learning_rate") == 5.0e-7
    assert launch.setting("no_such_key", "dflt") == "dflt"
    task = launch.task()
    assert task["resources"]["accelerators"] == "A100:4" and task["num_nodes"] == 2
    assert task["envs"]["TRL_OVERRIDES"] == "beta=0.2" and task["secrets"] == {"HF_TOKEN": None}
    with pytest.raises(TypeError):
        launch.overrides["beta"] = "1"  # immutable
    with pytest.raises(AttributeError):
        launch.nodes = 3


# ---------------------------------------------------------------- rooms and import rules

RULES = {
    # room: (orch rooms it may import, third-party it may import)
    "core": ({"core"}, {"yaml", "jsonschema"}),  # jsonschema: recipes against SkyPilot's schema (core/sky_schema.py)
    # huggingface_hub and httpx, its HTTP client: a model's config.json where its id names no model orch knows
    # (node/model_config.py, lazily)
    "node": ({"core", "node", "rehearsal.driver"}, {"huggingface_hub", "httpx"}),
    "launch": (
        {"core", "launch", "node.plan", "node.env", "node.script", "node.output", "node.procs", "node.model_config",
         "rehearsal.driver"},
        # pyarrow: only to read a --data .parquet file's first row (launch/data.py); huggingface_hub: `orch pull`, and
        # httpx, its HTTP client, whose connection errors `orch pull` names (launch/model_out.py)
        {"yaml", "sky", "pyarrow", "huggingface_hub", "httpx"},
    ),
    # trackio: --track; safetensors: the adapter file (train/checkpoints.save_adapter); httpx: huggingface_hub's HTTP
    # client, whose timeouts the prefetch retries (train/prefetch.fetch); kernels: the Kernels Hub client, which holds
    # the attention kernel the prefetch loaded (train/attention_kernel.py)
    "train": ({"core", "train"}, HEAVY - {"sky", "vllm"} | {"yaml", "huggingface_hub", "trackio", "safetensors",
                                                          "httpx", "kernels"}),
    "rehearsal": (  # bitsandbytes: imported before CUDA is faked (role.py), so its CPU kernels are the ones chosen;
        # httpx: huggingface_hub's HTTP client, whose connection errors name an unreachable Hub (rehearsal/data.py);
        # kernels, kernels_data (its metadata parser) and packaging (its versions): the attention kernel's builds for
        # the nodes (rehearsal/kernel.py)
        {"core", "node.plan", "train", "rehearsal"},
        HEAVY - {"sky", "vllm"} | {"huggingface_hub", "bitsandbytes", "httpx", "kernels", "kernels_data", "packaging"},
    ),
    "commands": ({"core", "launch", "node", "commands"}, {"yaml"}),
}


def _module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path):
    """Every module a file imports (at any depth, lazy imports in functions included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                yield dotted if node.module.startswith("orchestrator") and _module(dotted) else node.module


def _allowed(name: str, rooms: set[str]) -> bool:
    inner = name.removeprefix("orchestrator.")
    return any(inner == room or inner.startswith(room + ".") for room in rooms)


@pytest.mark.parametrize("room", sorted(RULES))
def test_each_room_imports_only_what_its_rule_allows(room):
    rooms, third_party = RULES[room]
    bad = []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "orchestrator":
                ok = _allowed(name, rooms)
            else:
                ok = top in sys.stdlib_module_names or top in third_party or top == "__future__"
            if not ok:
                bad.append((where, name))
    assert not bad, bad


def _sky_users():
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] == "sky":
                yield path.relative_to(PACKAGE).as_posix(), name


def test_only_the_sky_backend_imports_skypilot():
    assert {f for f, _ in _sky_users()} == {"launch/backends/sky.py"}


# ---------------------------------------------------------------- backends: commands are views


def _branches_on_the_kind_of_run(tree) -> list[str]:
    """Comparisons with a platform's or backend's name, `.startswith("local")`-style tests, reads of `.platform`
    outside the registry's own calls: the ways a command could decide by itself what kind of run it holds."""
    names = {"local", "sky", "sky-cluster", "sky-managed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                if isinstance(part, ast.Constant) and part.value in names:
                    found.append(f"line {node.lineno}: compares with {part.value!r}")
                if isinstance(part, ast.Attribute) and part.attr in ("platform", "backend"):
                    found.append(f"line {node.lineno}: compares .{part.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "startswith", "endswith"
        ):
            consts = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(c.value.split(" ")[0] in names for c in consts):
                found.append(f"line {node.lineno}: .{node.func.attr}({consts[0].value!r})")
    return found


def test_commands_import_no_backend_module_and_never_branch_on_the_kind_of_run():
    """The commands reach platforms only through the registry (launch/backends/__init__.py: get, for_record)."""
    bad = []
    for path in sorted((PACKAGE / "commands").glob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        bad += [(where, name) for name in _imports(path) if name.startswith("orchestrator.launch.backends.")]
        bad += [(where, why) for why in _branches_on_the_kind_of_run(ast.parse(path.read_text()))]
    assert not bad, bad
    # the check finds what it looks for
    sample = 'if record.get("backend").startswith("local"):\n    pass\nif args.platform == "sky":\n    pass\n'
    assert len(_branches_on_the_kind_of_run(ast.parse(sample))) == 3


def test_every_registered_backend_implements_the_interface():
    import inspect

    from orchestrator.launch import backends

    wanted = {name: inspect.signature(fn) for name, fn in vars(backends.Backend).items()
              if inspect.isfunction(fn) and not name.startswith("_")}  # fmt: skip
    assert set(wanted) == {"run", "state", "progress", "logs", "cancel", "down", "output"}
    for platform in backends.PLATFORMS:
        backend = backends.get(platform)
        assert backend.name == platform
        for name, signature in wanted.items():
            mine = inspect.signature(getattr(type(backend), name))
            assert list(mine.parameters) == list(signature.parameters), (platform, name, mine)


def test_a_platform_is_added_by_registering_it(tmp_path, monkeypatch):
    """What a new platform takes: a class with the interface, registered by name; records name it as `platform`."""
    from orchestrator.launch import backends, records

    (tmp_path / "my_platform.py").write_text(
        "class Mine:\n    name = 'mine'\n"
        "    def state(self, record, refresh=False):\n        return 'running (on mine)'\n"
        "    def progress(self, record):\n        return {'step': '3/9'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backends.PLATFORMS, "mine", "my_platform:Mine")
    record = records.Record("r", {}, {"platform": "mine", "backend": "mine (1 box)", "state": "running"})
    assert backends.for_record(record).state(record) == "running (on mine)"
    with pytest.raises(backends.OrchError, match="no backend for platform 'nope': orch knows local, mine, sky"):
        backends.get("nope")


def _root(node) -> str:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _edits_a_task(tree) -> list[str]:
    """Writes into a rendered task mapping: `task[...] = `, `task["envs"][k] = `, task.setdefault/update/... ."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else node.targets if isinstance(node, ast.Delete) else []  # fmt: skip
        found += [f"line {node.lineno}" for t in targets if isinstance(t, ast.Subscript) and _root(t) == "task"]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "setdefault", "update", "append", "pop", "clear"
        ):
            if _root(node.func.value) == "task":
                found.append(f"line {node.lineno}: .{node.func.attr}")
    return found


def test_the_task_is_rendered_last_and_never_edited():
    """A launch's additions (smoke, data mounts, hooks, buckets, prices) are applied to the resolved Launch; only
    Launch.task() builds a task mapping, and nothing on the launch side writes into one afterwards."""
    bad = []
    for path in sorted((PACKAGE / "launch").rglob("*.py")):
        if path.name != "resolved.py":
            bad += [(path.relative_to(PACKAGE).as_posix(), w) for w in _edits_a_task(ast.parse(path.read_text()))]
    assert not bad, bad
    planted = 'task["envs"]["X"] = "1"\ntask.setdefault("config", {})\ntask["file_mounts"]["/d"] = p\n'
    assert len(_edits_a_task(ast.parse(planted))) == 3


def _import_graph() -> dict[str, set[str]]:
    """orch module -> the orch modules it imports (at any depth: lazy imports in functions count)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_orchs_modules():
    assert _cycles(_import_graph()) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds one


def test_no_module_is_over_400_lines():
    long = {
        p.relative_to(PACKAGE).as_posix(): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


# ---------------------------------------------------------------- the wheel


@pytest.mark.cli
def test_wheel_holds_the_package_and_its_data(tmp_path):
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    result = subprocess.run([*argv, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("orch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("orchestrator/core/trl_args.json", "orchestrator/core/accelerate_args.json",
                 "orchestrator/configs/cpu.yaml", "orchestrator/train/__main__.py"):  # fmt: skip
        assert data in names, data
    sources = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sources <= names, sorted(sources - names)


# ---------------------------------------------------------------- habits: types, pre-commit


@pytest.mark.e2e  # a cold mypy cache (a fresh clone) takes ~18 s of CPU; `make lint` runs the same check
def test_the_launch_and_node_sides_type_check_at_zero_errors():
    """mypy over core/, launch/ and node/ as pyproject.toml configures it, no blanket ignores: every `type: ignore`
    names its error code and says why."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "type: ignore" in line:
                assert re.search(r"type: ignore\[[a-z-]+(, ?[a-z-]+)*\] *(#|-) *\S", line), f"{path}:{number}"


def test_pre_commit_runs_the_environments_own_ruff_and_mypy():
    config = ROOT / ".pre-commit-config.yaml"
    result = subprocess.run([sys.executable, "-m", "pre_commit", "validate-config", str(config)], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    import yaml

    hooks = [hook for repo in yaml.safe_load(config.read_text())["repos"] for hook in repo["hooks"]]
    assert {h["id"]: h["entry"].split()[0] for h in hooks} == {"ruff": ".venv/bin/ruff", "mypy": ".venv/bin/mypy"}
    assert all(h["language"] == "system" for h in hooks)


def test_every_orch_variable_orch_reads_is_registered():
    """core/knobs.py's KNOBS and OTHER are every ORCH_ variable orch reads (in the package, its scripts, recipes and
    examples): --env and a recipe's envs refuse any other ORCH_ name, so an unregistered one would be refused, and a
    misspelt knob (ORCH_MAX_COSTS=5) was dropped without a word. ORCH_DATA, ORCH_KERNEL and ORCH_WARM tag a check's
    stdout line; they are no variable."""
    import re

    from orchestrator.core.knobs import KNOBS, OTHER

    tags = {"ORCH_DATA", "ORCH_KERNEL", "ORCH_WARM"}
    found: dict[str, str] = {}
    for folder in ("orchestrator", "scripts", "recipes", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path == ROOT / "orchestrator" / "core" / "knobs.py":  # the registry itself reads none of them
                continue
            if path.is_file() and path.suffix in (".py", ".sh", ".yaml", ".sbatch", ".md", ""):
                for name in re.findall(r"(?<![A-Z0-9_])ORCH_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {name: where for name, where in found.items() if name not in {*KNOBS, *OTHER, *tags}}
    assert not unknown, unknown
    assert not [name for name in OTHER if name not in found], "OTHER names a variable nothing reads"
