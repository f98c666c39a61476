"""One row of the recipe's dataset, checked on the laptop before a GPU is paid for (`orch run`, cloud launches).

`python -m orchestrator.rehearsal.data` reads {dataset, config, split, model, trainer, max_length,
chat_template_path} as JSON on stdin and prints one JSON line: datasets streams one row (a Hub dataset or a local
directory, nothing else downloaded); its columns are checked against what the trainer reads; with the model's
tokenizer (transformers', from the Hub or a local path) the row is formatted as TRL would (the chat template for
conversational rows) and counted against max_length. A run of its own: launch-side `orch` never imports the
training stack (launch/datacheck.py calls it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator

from orchestrator.core import dataset_format, trainers


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"


def _ids(encoded) -> list:
    """apply_chat_template / __call__ output as a token id list (transformers 5 returns a BatchEncoding)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded[0]) if encoded and isinstance(encoded[0], list) else list(encoded)


def _texts(row: dict, trainer: str, text_field: str = "text") -> list:
    """What TRL feeds the model for this row, by the columns it reads (core/dataset_format.read): message lists or
    strings (a preference pair: chosen and rejected; a generating trainer: the prompt alone)."""
    columns = dataset_format.read(row, trainer, text_field) or ()
    prompt = row.get("prompt") if "prompt" in columns else None

    def joined(completion):
        if prompt is None:
            return completion
        if isinstance(prompt, list) and isinstance(completion, list):
            return prompt + completion
        return f"{prompt}{completion}"

    shape = trainers.spec(trainer).format
    if shape == "preference":
        return [joined(row["chosen"]), joined(row["rejected"])]
    if shape == "prompt":
        return [prompt]
    if "completion" in columns:
        return [joined(row["completion"])]
    return [row[columns[0]]]  # SFT's messages or text field


def _unreachable(name: str) -> str | None:
    """Why the Hub cannot be asked about dataset `name` from here, or None (it answered, or the name is a local path,
    or HF_HUB_OFFLINE asks for the cache alone). One metadata request with a timeout: without it datasets retries the
    failed request and then raises about a closed HTTP client, not about the network."""
    import os

    if os.path.exists(name) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().dataset_info(name, timeout=10)
    except HfHubHTTPError:  # the Hub answered (not found, gated, private): load_dataset says which
        return None
    except (httpx.TransportError, OSError) as exc:
        return _why(exc)
    except Exception:  # noqa: BLE001 - anything else is load_dataset's to report
        return None
    return None


def _eval_split(request: dict) -> dict | None:
    """With an eval_strategy, the split the nodes evaluate on must exist (and hold a row): the refusal, or None."""
    if not request.get("eval"):
        return None
    from datasets import load_dataset

    name, split, strategy = request["dataset"], request["eval"]["split"], request["eval"]["strategy"]
    why = f"eval_strategy={strategy} evaluates on dataset_test_split={split}"
    fix = "set dataset_test_split to one of its splits, or eval_strategy=no"
    try:
        next(iter(load_dataset(name, request.get("config"), split=split, streaming=True)))
    except StopIteration:
        return {"fatal": True, "error": f"dataset {name} has no rows in split {split} ({why}); {fix}"}
    except (FileNotFoundError, ValueError) as exc:
        return {"fatal": True, "error": f"dataset {name}: {why}, which it lacks ({_why(exc)}); {fix}"}
    except Exception:  # noqa: BLE001 - network, auth: as for the training split, not the run's fault
        return None
    return None


def check(request: dict) -> dict:
    name, trainer = request["dataset"], request["trainer"]
    unreachable = _unreachable(name)
    if unreachable:
        return {"fatal": False, "error": f"cannot reach the Hub from here for {name} ({unreachable})"}
    from datasets import load_dataset

    try:
        stream = load_dataset(name, request.get("config"), split=request.get("split") or "train", streaming=True)
        row = next(iter(stream))
    except StopIteration:
        return {"fatal": True, "error": f"dataset {name} has no rows in split {request.get('split')}"}
    except (FileNotFoundError, ValueError) as exc:  # no such dataset or split (datasets' DatasetNotFoundError too)
        if str(exc).startswith("Bad split"):
            return {"fatal": True, "error": f"dataset {name}: dataset_train_split={request.get('split')}: {_why(exc)}; "
                                            "set dataset_train_split to one of them"}  # fmt: skip
        return {"fatal": True, "error": f"dataset {name}: {_why(exc)}"}
    except Exception as exc:  # noqa: BLE001 - network, auth: the laptop may not reach the Hub; not the run's fault
        return {"fatal": False, "error": f"could not stream a row of {name} ({_why(exc)})"}
    evaluated = _eval_split(request)
    if evaluated:
        return evaluated
    text_field = request.get("text_field") or "text"
    wrong = dataset_format.missing(row, trainer, text_field)
    if wrong:
        return {"fatal": True, "error": f"dataset {name}: its first row {wrong}", "columns": sorted(row)}
    out = {"columns": sorted(row)}
    texts = _texts(row, trainer, text_field)
    chat = any(dataset_format.conversational(t) for t in texts)
    out["conversational"] = chat
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(request["model"])
    except Exception as exc:  # noqa: BLE001 - a gated model without HF_TOKEN here, no network
        out["note"] = f"chat template and length not checked: no tokenizer for {request['model']} ({_why(exc)})"
        return out
    if request.get("chat_template_path"):
        out["note"] = "chat template: the recipe's chat_template_path (not checked here)"
        return out
    if chat and not tokenizer.chat_template:
        return {
            **out,
            "fatal": True,
            "error": f"{request['model']}'s tokenizer has no chat template and {name}'s rows are conversational: "
            "use an instruct model or set chat_template_path in the TRL config",
        }
    if request.get("assistant_only_loss") and chat:  # TRL's SFT trainer patches a known template, refuses others
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        if not has_generation_markers(tokenizer.chat_template):
            try:
                get_training_chat_template(tokenizer)
            except ValueError as exc:
                return {**out, "fatal": True, "error": f"assistant_only_loss=true with {request['model']}'s chat "
                        f"template: {_why(exc)}; set chat_template_path to a template with generation markers"}
    def tokens(text, prompt: bool = False) -> int:
        if dataset_format.conversational(text):
            return len(_ids(tokenizer.apply_chat_template(text, tokenize=True, add_generation_prompt=prompt)))
        return len(_ids(tokenizer(str(text))["input_ids"]))

    out["tokens"] = max(map(tokens, texts))
    if trainers.spec(trainer).drops_by == "prompt" and row.get("prompt") is not None:  # as TRL's filter counts it
        out["prompt_tokens"] = tokens(row["prompt"], prompt=True)
    return out


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """What the owners' code prints goes nowhere, through a real file, as a rank's goes to one: DeepSpeed's libaio check
    dups stderr's file descriptor (op_builder has_function), which failed on a StringIO, and the rehearsal refused NVMe
    offload as "no libaio" on a head node that had it (tests/test_nvme_offload.py)."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def answer(tag: str, result_of: Callable[[], dict]) -> None:
    """The one line a launch-side check reads, `<tag> <json>`: whatever the libraries print or warn on the way is
    dropped (launch/datacheck.py and launch/kernelcheck.py quote their own lines)."""
    warnings.filterwarnings("ignore")
    with quiet():
        result = result_of()
    sys.stdout.write(f"{tag} {json.dumps(result)}\n")


def main() -> None:
    request = json.loads(sys.stdin.read())
    answer("ORCH_DATA", lambda: check(request))


if __name__ == "__main__":
    main()
