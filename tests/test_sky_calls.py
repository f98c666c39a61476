"""Every SkyPilot call in orch's code names a function the installed SkyPilot has, with arguments its signature takes.

mypy does not follow SkyPilot (pyproject.toml: following it took half of a cold check), so this is where a SkyPilot
upgrade that renames a function or a keyword shows up before the bed's tests (test_sky_bed.py) run the calls for real.
"""

import ast
import importlib
import inspect
import re

import pytest
from conftest import ROOT

pytestmark = pytest.mark.unit

SOURCES = sorted((ROOT / "orchestrator").rglob("*.py"))


def sky_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted SkyPilot path, for every `import sky...` / `from sky... import ...` in a module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sky" or alias.name.startswith("sky."):
                    # `import sky.jobs as jobs` binds jobs to sky.jobs; `import sky.jobs` binds sky itself
                    names[alias.asname or "sky"] = alias.name if alias.asname else "sky"
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith("sky."):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def chain(node: ast.AST) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for anything else (a call's result, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def resolve(dotted: str):
    """The object at a dotted path, importing submodules as needed."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def sky_calls():
    """(where, dotted path, positional count, keyword names, whether **kwargs follow) for each call of a SkyPilot
    name in orchestrator/; `sky = _sky()` (launch/backends/sky.py's lazy import) counts as `import sky`."""
    for path in SOURCES:
        source = path.read_text()
        if not re.search(r"\bimport sky\b|\bfrom sky\b|\b_sky\(", source):  # no SkyPilot name: not parsed (~1 s)
            continue
        tree = ast.parse(source)
        names = sky_names(tree)
        if "_sky" in {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}:
            names["sky"] = "sky"
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (parts := chain(node.func)) and parts[0] in names and len(parts) > 1:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                starred = any(isinstance(a, ast.Starred) for a in node.args)
                keywords = [k.arg for k in node.keywords if k.arg is not None]
                spread = len(keywords) < len(node.keywords)  # **options: the rest is known only at run time
                positional = None if starred else len(node.args)
                yield where, ".".join([names[parts[0]], *parts[1:]]), positional, keywords, spread


CALLS = list(sky_calls())


def test_the_scan_finds_the_sdk_calls_orch_makes():
    called = {call[1] for call in CALLS}
    assert {"sky.launch", "sky.jobs.launch", "sky.tail_logs", "sky.jobs.queue_v2", "sky.status", "sky.cancel",
            "sky.down", "sky.stream_and_get", "sky.Task.from_yaml_config"} <= called, sorted(called)  # fmt: skip


@pytest.mark.parametrize("where, dotted, positional, keywords, spread", CALLS, ids=[f"{c[0]}-{c[1]}" for c in CALLS])
def test_each_call_binds_to_skypilots_own_signature(where, dotted, positional, keywords, spread):
    target = resolve(dotted)
    assert callable(target), f"{where}: {dotted} is not callable in this SkyPilot"
    signature = inspect.signature(target.__init__ if inspect.isclass(target) else target)
    params = list(signature.parameters.values())
    if inspect.isclass(target):
        params = params[1:]  # self
    if positional is not None:
        args = [object()] * positional
        kwargs = dict.fromkeys(keywords, object())
        taken = signature.replace(parameters=params)
        bind = taken.bind_partial if spread else taken.bind
        try:
            bind(*args, **kwargs)
        except TypeError as error:
            pytest.fail(f"{where}: {dotted}{signature} does not take {positional} positional and {keywords}: {error}")
    else:
        accepted = {p.name for p in params} | ({"*"} if any(p.kind is p.VAR_KEYWORD for p in params) else set())
        assert "*" in accepted or set(keywords) <= accepted, f"{where}: {dotted}{signature} lacks {keywords}"
