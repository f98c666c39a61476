"""A run's progress for `orch status`: step/total, last loss, the trainer's first own measure (core/trainers
`metrics`: a reward, an accuracy, a margin; the loss alone says little for GRPO or RLOO), tokens/s, ETA and spend.

Read from what orch already writes: a local run's <output_dir>/orch/log.jsonl (its last line), or the step lines
a node prints (`[orch] step 8/8 loss=4.12 ... rewards/accuracies=0.625 | 3,525 tok/s | elapsed 0m16s | ETA 0m00s |
$0.01 spent`), which `orch status RUN` reads from SkyPilot's logs and keeps in the run's record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from orchestrator.core import trainers
from orchestrator.core.timeline import duration

KEYS = ("step", "loss", "metric", "tok_s", "eta", "spent")
STEP_LINE = re.compile(r"\[orch\] step (\d+)/(\d+) (.*)$")


def from_log(path: Path) -> dict[str, str]:
    """From the end of a local run's log.jsonl (read from the end: cheap for a long run): the step of its last line,
    the figures of the last training log (the trainer's final summary line has no loss)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            tail = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return {}
    logged = []
    for line in tail[-20:]:
        try:
            logged.append(json.loads(line))
        except ValueError:
            continue  # the first line of the window may be cut
    if not logged:
        return {}
    last = logged[-1]
    trained: dict = next((x for x in reversed(logged) if "loss" in x), {})
    total = last.get("max_steps") or trained.get("max_steps") or "?"
    shown = {"step": f"{last['step']}/{total}"} if "step" in last else {}
    if "loss" in trained:
        shown["loss"] = f"{trained['loss']:.4g}"
    spec = trainers.SPECS.get(str(trained.get("trainer")))  # a log of an orch before 2026-11-25 names none
    for key, value in spec.headline(trained)[:1] if spec else ():
        shown["metric"] = f"{key}={value:.4g}"
    if "tokens_per_s" in trained:
        shown["tok_s"] = f"{trained['tokens_per_s']:,.0f}"
    if "eta_s" in trained:
        shown["eta"] = duration(trained["eta_s"])
    if "spent_usd" in trained:
        shown["spent"] = f"${trained['spent_usd']:,.2f}"
    return shown


def from_lines(text: str) -> dict[str, str]:
    """The last step line among a node's output lines (SkyPilot's logs of the run)."""
    for line in reversed(text.splitlines()):
        match = STEP_LINE.search(line)
        if not match:
            continue
        step, total, rest = match.groups()
        shown = {"step": f"{step}/{total}"}
        if loss := re.search(r"\bloss=(\S+)", rest):
            shown["loss"] = f"{float(loss.group(1)):.4g}"
        words = rest.split(" | ", 1)[0].split()
        if own := next((w for w in words if "=" in w and w.split("=", 1)[0] not in trainers.PLAIN_METRICS), None):
            shown["metric"] = own
        if rate := re.search(r"\| ([\d,]+) tok/s", rest):
            shown["tok_s"] = rate.group(1)
        if eta := re.search(r"\| ETA (\S+)", rest):
            shown["eta"] = eta.group(1)
        if spent := re.search(r"\| (\$[\d,.]+) spent", rest):
            shown["spent"] = spent.group(1)
        return shown
    return {}
