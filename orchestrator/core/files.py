"""The one way orch reads a file someone else wrote (recipes, TRL and Accelerate configs, records, model configs,
`--data`): regular files only (never a device, a FIFO or a directory, whatever a link points at), UTF-8, config
and record files capped in size (data files are streamed, never capped), YAML without anchors or aliases (an alias
bomb cannot expand) and without duplicate keys. Every failure is one OrchError line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import yaml

from orchestrator.core.errors import OrchError

CONFIG_MAX = 1 << 20
"""Recipes, TRL and Accelerate configs, run records: 1 MiB (the largest shipped one is under 4 KiB)."""
JSON_MAX = 16 << 20
"""A model's config.json and other JSON documents: 16 MiB."""
MAX_DEPTH = 64
"""Nesting a YAML or JSON document may have (configs are 3 levels deep)."""

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def open_regular(path: str | Path, what: str):
    """A binary file object of a regular file. A link is followed, but what it points at must be a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without waiting for a writer
    except OSError as exc:
        raise OrchError(f"{what} {path} cannot be read ({exc.strerror}); check the path") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
        raise OrchError(f"{what} {path} is {kind}, not a regular file; point it at a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_text(path: str | Path, what: str, limit: int = CONFIG_MAX) -> str:
    """A regular file's whole text, refused past `limit` bytes or when it is not UTF-8."""
    with open_regular(path, what) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OrchError(f"{what} {path} is larger than {limit >> 10} KiB; this is not a config orch reads (wrong "
                        "path?)")  # fmt: skip
    return decode(data, f"{what} {path}")


def decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise OrchError(f"{where} is not UTF-8 text (line {line}, byte {exc.start}); save it as UTF-8") from None


def parse_yaml(text: str, where: str):
    """YAML text as Python data, refusing anchors/aliases, duplicate keys and nesting past MAX_DEPTH."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise OrchError(f"{where} is not valid YAML{at} ({problem}); fix the file") from None
    except RecursionError:
        raise OrchError(f"{where} nests deeper than {MAX_DEPTH} levels; fix the file") from None
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node, where: str) -> None:
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        line = node.start_mark.line + 1
        if id(node) in seen:  # the composer hands out the anchored node again for each alias
            raise OrchError(f"{where} uses a YAML alias (line {line}): anchors and aliases are not accepted; write "
                            "the values out")  # fmt: skip
        seen.add(id(node))
        if depth > MAX_DEPTH:
            raise OrchError(f"{where} nests deeper than {MAX_DEPTH} levels (line {line}); fix the file")
        if isinstance(node, yaml.MappingNode):
            keys: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value == "<<" and key.tag == "tag:yaml.org,2002:merge":
                        raise OrchError(f"{where} uses a YAML merge key (line {key.start_mark.line + 1}); write the "
                                        "values out")  # fmt: skip
                    if key.value in keys:
                        raise OrchError(f"{where} sets {key.value!r} twice (lines {keys[key.value]} and "
                                        f"{key.start_mark.line + 1}); keep one")  # fmt: skip
                    keys[key.value] = key.start_mark.line + 1
                stack += [(key, depth + 1), (value, depth + 1)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, depth + 1) for item in node.value]


def load_yaml(path: str | Path, what: str, limit: int = CONFIG_MAX):
    return parse_yaml(read_text(path, what, limit), f"{what} {path}")


def load_json(path: str | Path, what: str, limit: int = JSON_MAX):
    text = read_text(path, what, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise OrchError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix the file") from None
    except RecursionError:
        raise OrchError(f"{what} {path} nests too deep; fix the file") from None


def lines(path: str | Path, what: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a regular UTF-8 text file, streamed (a data file is never read whole)."""
    with open_regular(path, what) as fh:
        for number, raw in enumerate(fh, start=1):
            yield number, decode(raw, f"{what} {path} line {number}")
