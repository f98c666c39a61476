"""One row of a recipe's dataset checked before a cloud launch (rehearsal/data.py does it in a process of its own,
with datasets and transformers): columns (a missing one stops the launch, exit 2), the chat template, and what
max_length cuts. ORCH_DATA_CHECK=off skips it; a laptop that cannot reach the Hub gets a note, not an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from orchestrator.core import trainers
from orchestrator.core.errors import OrchError
from orchestrator.core.knobs import knob
from orchestrator.core.overrides import truthy
from orchestrator.launch.resolved import Launch

TIMEOUT_S = 180


def run(launch: Launch) -> str | None:
    """The line to print, or None when skipped; an OrchError when the data cannot train."""
    if knob(os.environ, "ORCH_DATA_CHECK", "on") == "off":
        return None
    name = str(launch.setting("dataset_name", ""))
    if launch.setting("datasets"):  # TRL's mixture, which the training entry loads in place of dataset_name
        return "[orch] data: a `datasets` mixture: not checked here (the nodes load it with TRL's get_dataset)"
    if not name or name.startswith("/orch-data"):  # no dataset, or a --data file (checked row by row already)
        return None
    given = launch.settings.get("max_length", 1024)
    max_length = None if given is None else str(given)  # None: max_length: null, which truncates nothing
    request = {
        "dataset": name,
        "config": launch.setting("dataset_config"),
        "split": launch.setting("dataset_train_split", "train"),
        "model": str(launch.setting("model_name_or_path", "")),
        "trainer": launch.trainer,
        "text_field": str(launch.setting("dataset_text_field", "text")),  # SFT's text column
        "chat_template_path": launch.setting("chat_template_path"),
        "assistant_only_loss": truthy(launch.setting("assistant_only_loss", False)),
    }
    if launch.evaluation:  # TRL's scripts evaluate on dataset_test_split: looked up on the nodes after the model loads
        request["eval"] = dict(zip(("strategy", "split"), launch.evaluation, strict=True))
    try:
        done = subprocess.run([sys.executable, "-m", "orchestrator.rehearsal.data"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
        line = next(x for x in done.stdout.splitlines() if x.startswith("ORCH_DATA "))
        result = json.loads(line.split(" ", 1)[1])
    except subprocess.TimeoutExpired:
        return f"[orch] data: {name} not checked (no row in {TIMEOUT_S} s)"
    except StopIteration:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"[orch] data: {name} not checked (the check failed: {tail[:200]})"
    if result.get("fatal"):
        raise OrchError(result["error"])
    if result.get("error"):
        return f"[orch] data: {result['error']}: not checked"
    text = f"[orch] data: {name}, first row: {', '.join(result['columns'])}"
    if result.get("note"):
        return f"{text}; {result['note']}"
    tokens = result["tokens"]
    shaped = "with the chat template" if result["conversational"] else "as text"
    spec = trainers.spec(launch.trainer)
    prompt = result.get("prompt_tokens")
    keeps = str(launch.setting("truncation_mode", "keep_start")) == "keep_end"
    if max_length and prompt is not None and prompt >= int(max_length) and not keeps:
        return (f"{text}; its prompt alone is {prompt:,} tokens {shaped}: TRL's {launch.trainer} trainer drops a row "
                f"whose prompt fills max_length {max_length}")  # fmt: skip
    if max_length and spec.drops_by == "pair" and tokens > int(max_length):
        return (f"{text}; {tokens:,} tokens {shaped}: TRL's {launch.trainer} trainer drops such a pair (max_length "
                f"{max_length})")  # fmt: skip
    if max_length and tokens > int(max_length):
        cut = 100 * (tokens - int(max_length)) / tokens
        return f"{text}; {tokens:,} tokens {shaped}: max_length {max_length} truncates it ({cut:.0f}% cut)"
    within = f"within max_length {max_length}" if max_length else "untruncated (max_length: null)"
    return f"{text}; {tokens:,} tokens {shaped}, {within}"
