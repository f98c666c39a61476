"""Trackio's files as orch keeps them (standard library only; the launch side reads them too): each node's copy of
its database under <output_dir>/trackio/node<N>/<project>.db, and one database merging them for the dashboard."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

MERGED_TABLES = ("metrics", "system_metrics", "configs", "alerts")


def node_copy(root: Path, node: int, project: str) -> Path:
    return root / "trackio" / f"node{node}" / f"{project}.db"


def backup(source: Path, dest: Path) -> None:
    """A consistent copy of a SQLite database (sqlite's backup API), written beside `dest` and renamed over it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with sqlite3.connect(source) as src, sqlite3.connect(tmp) as out:
            src.backup(out)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def unreadable(db: Path) -> str:
    """Why a node's database cannot be merged ('' when it can): not SQLite, damaged, or not Trackio's."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            check = con.execute("PRAGMA quick_check").fetchone()
    except sqlite3.Error as exc:
        return str(exc)
    if check and check[0] != "ok":
        return f"damaged ({check[0]})"
    return "" if "metrics" in tables else "not a Trackio database (no metrics table)"


def node_databases(output_dir: Path) -> dict[str, list[Path]]:
    """{project: [each node's copy, node 0 first]} under <output_dir>/trackio/."""
    found: dict[str, list[Path]] = {}
    for db in sorted((output_dir / "trackio").glob("node*/*.db"), key=lambda p: int(p.parent.name[4:] or 0)):
        found.setdefault(db.stem, []).append(db)
    return found


def merge(databases: list[Path], dest: Path) -> Path:
    """One Trackio database holding every node's rows: node 0's copy, plus the other nodes' rows of the tables
    Trackio reads runs and curves from (the columns both have; ids renumbered)."""
    backup(databases[0], dest)
    with sqlite3.connect(dest) as out:
        for i, db in enumerate(databases[1:]):
            out.execute(f"ATTACH DATABASE ? AS node{i}", (str(db),))
            for table in MERGED_TABLES:
                theirs = {r[1] for r in out.execute(f"PRAGMA node{i}.table_info({table})")}
                ours = [r[1] for r in out.execute(f"PRAGMA main.table_info({table})")]
                columns = ", ".join(c for c in ours if c in theirs and c != "id")
                if columns:
                    out.execute(f"INSERT OR IGNORE INTO main.{table} ({columns}) SELECT {columns} FROM node{i}.{table}")
            out.commit()
            out.execute(f"DETACH DATABASE node{i}")
    return dest
