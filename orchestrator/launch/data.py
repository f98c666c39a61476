"""`orch run --data FILE`: the user's own rows, checked here before anything costs money, then handed to TRL.

A JSON Lines or Parquet file in the trainer's format (TRL's dataset formats: conversational or standard). Every
JSON Lines row is read (Parquet: its first row, then the columns TRL reads of every row for a null or an empty list,
with pyarrow: its schema types every row alike); the first row TRL could not read (a missing column, a value of
another type, strings and conversations mixed, other columns or another format than the first row's:
core/dataset_format.py) gives one line naming it and a row that would do. The file then travels as
<dir>/train.<ext>: a SkyPilot file mount at DATA_MOUNT on a cloud, a link in orch's cache locally (a sample of its
first rows with --smoke), and TRL loads it with `dataset_name=<dir>` (datasets infers the format and the split from
the file name).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from orchestrator.core import dataset_format, files
from orchestrator.core.errors import OrchError

DATA_MOUNT = "/orch-data"
SMOKE_ROWS = 128


def _parquet(path: Path, batch_size: int, columns: list[str] | None = None):
    """The file's record batches, read by pyarrow; a corrupt or truncated file is one OrchError."""
    import pyarrow.parquet as pq

    files.open_regular(path, "--data").close()  # a regular file (pyarrow's own reader must open it by path: given
    try:  # a Python file object its threads abort the interpreter at exit)
        yield from pq.ParquetFile(str(path)).iter_batches(batch_size=batch_size, columns=columns)
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError...
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise OrchError(f"--data {path}: not a readable Parquet file ({reason}); write it again") from None


def _rows(path: Path):
    """(line number, row) of a JSON Lines file, or of a Parquet file's first row."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise OrchError(f"--data {path}: reading Parquet here needs pyarrow (pip install pyarrow)") from None
        first = next(_parquet(path, 1), None)
        for row in first.to_pylist() if first is not None else []:
            yield 1, row
        return
    for number, line in files.lines(path, "--data"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deep"
            raise OrchError(f"--data {path}: line {number} is not JSON ({why}); give one JSON object per line"
                            ) from None  # fmt: skip
        yield number, row


def _parquet_rest(path: Path, columns: tuple[str, ...], trainer: str) -> int:
    """A Parquet file's rows (its schema types every row as the first, checked already): the first that holds a null
    or an empty list in a column TRL reads is one OrchError; else the number of rows. Read in batches of the columns
    TRL reads, never the whole file at once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    seen = 0
    for batch in _parquet(path, 65536, list(columns)):
        for name in columns:
            column = batch.column(name)
            bad = pc.is_null(column)
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                bad = pc.or_(bad, pc.fill_null(pc.equal(pc.list_value_length(column), 0), False))
            at = pc.index(bad, True).as_py()
            if at >= 0:
                value = column[at].as_py()
                raise OrchError(f"--data {path}: row {seen + at + 1} "
                                f"{dataset_format.unreadable(name, value, trainer)}")  # fmt: skip
        seen += batch.num_rows
    return seen


def check(path: Path, trainer: str, text_field: str = "text") -> int:
    """The number of rows checked; an OrchError naming the first row TRL could not read (text_field: SFT's
    dataset_text_field)."""
    if path.suffix not in (".jsonl", ".parquet"):
        raise OrchError(f"--data {path}: give a JSON Lines (.jsonl) or Parquet (.parquet) file in the {trainer} format")
    if not path.exists():
        raise OrchError(f"--data {path}: no such file")
    count, first = 0, None  # first: row 1's dataset_format.Shape, which every row needs
    for number, row in _rows(path):  # a Parquet file: its first row
        if not isinstance(row, dict):
            raise OrchError(f"--data {path}: line {number} is a JSON {type(row).__name__}, not an object")
        wrong, seen = dataset_format.judge(row, trainer, text_field)
        if not wrong:
            first = first or seen
            wrong = dataset_format.unlike(seen, first)
        if wrong:
            raise OrchError(f"--data {path}: row {number} {wrong}")
        count += 1
    if first is None:
        raise OrchError(f"--data {path}: the file holds no rows")
    if path.suffix == ".parquet":
        return _parquet_rest(path, first[0], trainer)
    return count


def local_dir(path: Path, smoke: bool, cache: Path) -> Path:
    """A directory holding the file as train.<ext> (with smoke, its first SMOKE_ROWS rows) for a local run."""
    digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_mtime_ns}:{smoke}".encode()).hexdigest()[:12]
    out = cache / "data" / digest
    target = out / f"train{path.suffix}"
    if target.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{target.name}.tmp"
    if smoke and path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
            kept = 0
            for line in src:
                if line.strip() and kept < SMOKE_ROWS:
                    dst.write(line if line.endswith("\n") else line + "\n")
                    kept += 1
    elif smoke:  # Parquet: its first rows, as pyarrow reads them
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_batches([next(_parquet(path, SMOKE_ROWS))]), str(tmp))
    else:
        os.symlink(path.resolve(), tmp)
    os.replace(tmp, target)
    return out


def use(file: str, launch, local: bool, smoke: bool, user_overrides: dict[str, str]):
    """`orch run --data FILE`: checked here with the launch's settings (SFT's dataset_text_field); TRL then reads it
    as dataset_name=<its directory>, a key=value word of the user's (added to `user_overrides`, so it wins over the
    recipe's and smoke's). Returns (the file, the launch with it, the line to say once every check passed)."""
    from orchestrator.core.smoke import cache_root

    path = Path(file)
    for key, wanted in (("dataset_name", None), ("dataset_train_split", "train")):
        if key in user_overrides and user_overrides[key] != wanted:
            raise OrchError(f"--data {file} and {key}={user_overrides[key]}: --data is the dataset TRL reads, as "
                            f"dataset_name=<its folder> and its one split, train: drop {key}=, or drop "
                            "--data")  # fmt: skip
    rows = check(path, launch.trainer, str(launch.setting("dataset_text_field", "text")))
    where = local_dir(path, smoke, cache_root().parent) if local else Path(DATA_MOUNT)
    given = {"dataset_name": str(where), "dataset_train_split": "train"}
    user_overrides.update(given)
    kept = f"; the smoke run trains on its first {min(rows, SMOKE_ROWS)}" if smoke else ""
    counted = f"{rows:,} row{'s' if rows != 1 else ''}"
    line = f"[orch] data: {path} ({counted}) has the columns TRL's {launch.trainer} trainer reads{kept}"
    return path, launch.replace(overrides={**launch.overrides, **given}), line


def check_launch(launch, smoke: bool) -> None:
    """What the resolved launch would do with the file. A TRL `datasets:` mixture is loaded in place of dataset_name:
    the file would be dropped without a word. The file is one split, `train`: an eval_strategy evaluates on
    dataset_test_split (TRL's default `test`), which the nodes would look up after the model loaded (KeyError:
    'test'); smoke runs evaluate on `train` already."""
    if launch.setting("datasets"):
        raise OrchError(f"--data is given to TRL as dataset_name, and the TRL settings ({launch.envs['TRL_CONFIG']} "
                        "and the key=value overrides) set a `datasets` mixture, which TRL loads in its place: remove "
                        "`datasets`, or drop --data")  # fmt: skip
    if smoke or launch.evaluation is None or launch.evaluation[1] == "train":
        return
    strategy, split = launch.evaluation
    raise OrchError(f"--data gives one split, train, and eval_strategy={strategy} evaluates on dataset_test_split="
                    f"{split}: add dataset_test_split=train to evaluate on the same rows, or eval_strategy=no")


def mount(launch, path: Path):
    """A cloud task reads the file from DATA_MOUNT (SkyPilot uploads it with the task): the launch with that mount.
    SkyPilot's rsync of a mount's source runs in a shell on this machine: a path holding anything but plain
    characters is staged first, under a plain name in orch's cache (a hard link, else a copy), never refused."""
    from orchestrator.core import slots

    source = path.resolve()
    if not slots.safe_path(str(source)):
        source = stage(source)
        print(f"[orch] data: {path} is uploaded as {source} (its path holds characters a shell would read)",
              flush=True)  # fmt: skip
    return launch.replace(mounts={**launch.mounts, f"{DATA_MOUNT}/train{path.suffix}": str(source)})


def sample_of(launch) -> Path | None:
    """The first rows of the launch's --data file (its mount's source), as a smoke run trains on them: the rehearsal
    builds the trainer on them. None without a --data file."""
    from orchestrator.core.smoke import cache_root

    source = next((v for k, v in launch.mounts.items() if k.startswith(f"{DATA_MOUNT}/") and v), None)
    return local_dir(Path(source), True, cache_root().parent) if source else None


def stage(path: Path) -> Path:
    """The file under orch's cache as data/staged/<hash>/train.<ext>: a plain path, made atomically."""
    import shutil

    from orchestrator.core import slots
    from orchestrator.core.smoke import cache_root

    stat = path.stat()
    digest = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root().parent.resolve() / "data" / "staged" / digest
    target = out / f"train{path.suffix}"
    if not slots.safe_path(str(target)):
        raise OrchError(f"--data {path}: orch's cache {out} holds characters a shell would read; set ORCH_CACHE_DIR "
                        "to a plain path")  # fmt: skip
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{target.name}.{os.getpid()}.tmp"
    try:
        os.link(path, tmp)
    except OSError:  # another file system
        shutil.copyfile(path, tmp)
    os.replace(tmp, target)
    return target
