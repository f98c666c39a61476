"""When a run saves, evaluates and logs, against the time its steps take (node side, rank 0 says it): what a failure
loses at most, and an evaluation that would take much of the run, measured at the first one."""

from __future__ import annotations

import math
import statistics
import time

from orchestrator.core.timeline import duration


def took(seconds: float) -> str:
    if seconds >= 60:
        return duration(seconds)
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"


def _word(strategy: object) -> str:
    """A TrainingArguments strategy (save_strategy, logging_strategy, eval_strategy: an enum) as its word."""
    return str(getattr(strategy, "value", strategy))


def saves_after(step: int, max_steps: int, strategy: str, save_steps: float, epochs: float,
                eval_steps: float) -> list[int]:  # fmt: skip
    """The steps after `step` at which transformers will save (DefaultFlowCallback): every save_steps and at the last
    step under `steps` (TrainerState's save_steps: a ratio is made steps at train start); at each epoch's end under
    `epoch`; at most at every evaluation under `best`."""
    if max_steps <= 0 or step >= max_steps:
        return []
    if strategy == "steps" and save_steps >= 1:
        ends = {*range(int(save_steps), max_steps + 1, int(save_steps)), max_steps}
    elif strategy == "epoch" and epochs > 0:
        ends = {min(max_steps, math.ceil(max_steps / epochs * e)) for e in range(1, math.ceil(epochs) + 1)}
    elif strategy == "best" and eval_steps >= 1:
        ends = set(range(int(eval_steps), max_steps + 1, int(eval_steps)))
    else:
        return []
    return sorted(s for s in ends if s > step)


def saves(args, state) -> tuple[str, list[int]]:
    """A trainer's save strategy and the saves still to come (saves_after), from its TrainingArguments and state."""
    strategy = _word(args.save_strategy)
    return strategy, saves_after(state.global_step, state.max_steps, strategy, state.save_steps or 0,
                                 args.num_train_epochs, state.eval_steps or 0)  # fmt: skip


def cadence(step: int, max_steps: int, strategy: str, saves: list[int], eta_s: float) -> str:
    """When the checkpoints come at the rate measured so far (rank 0, once the step time is known): what a failure or
    a preemption loses at most. A warning where nothing is saved before the final model of a run an hour long."""
    per_step = eta_s / max(1, max_steps - step)
    if saves:
        every = saves[1] - saves[0] if len(saves) > 1 else 0
        steps = "step" if every == 1 else f"{every} steps"
        then = f", then every {steps} (~{took(every * per_step)})" if every else ""
        return (f"[orch] checkpoints: the next at step {saves[0]} (~{took((saves[0] - step) * per_step)} at this "
                f"rate){then}; a failure or a preemption loses the steps since the last one")  # fmt: skip
    if strategy != "no" or eta_s < 3600:
        return ""
    every = max(1, round(1800 / max(per_step, 1e-9)))
    return (f"[orch] warning: save_strategy=no: nothing is saved before the final model at step {max_steps}, "
            f"~{duration(eta_s)} from now; a failure or a preemption before then loses the whole run (save_strategy="
            f"steps save_steps={every} saves about every 30 minutes at this rate)")


def unlogged(args, state) -> str:
    """A logging interval past the last step logs nothing: orch's non-finite check and straggler naming judge there."""
    beyond = state.logging_steps > state.max_steps > 0 and not args.logging_first_step
    if _word(args.logging_strategy) != "steps" or not beyond:
        return ""
    return (f"[orch] warning: logging_steps={args.logging_steps} is beyond max_steps={state.max_steps}: no step will "
            "be logged (no loss, and the non-finite check and the straggler naming judge at logging steps)")


def eval_share(args, state, timed: list[list[float]]) -> str | None:
    """At an evaluation (eval_strategy=steps), which began as the last step ended: its time against the steps between
    two (each step's own wall time, [began, ended], monotonic), over the run (transformers evaluates at the last step
    too). A warning where evaluations would take a quarter of the run or more, '' where they would not, None where
    fewer than two steps were timed (the first one warms up)."""
    if _word(args.eval_strategy) != "steps":
        return ""
    if len(timed) < 2 or not timed[-1][1] or not state.eval_steps or state.max_steps <= 0:
        return None
    per_step = statistics.median(ended - began for began, ended in timed[1:] if ended)
    return share_words(state.global_step, state.max_steps, int(state.eval_steps), time.monotonic() - timed[-1][1],
                       per_step)


def share_words(step: int, max_steps: int, eval_steps: int, eval_s: float, per_step: float) -> str:
    evals = math.ceil(max_steps / eval_steps)
    evaluating, training = evals * eval_s, max_steps * per_step
    share = evaluating / max(1e-9, evaluating + training)
    if share < 0.25:
        return ""
    fewer = math.ceil(max_steps / max(1, int(training / 9 / max(eval_s, 1e-9))))  # evaluations near a tenth
    steps = "a step takes" if eval_steps == 1 else f"{eval_steps} steps take"
    return (f"[orch] warning: the evaluation at step {step} took {took(eval_s)} and {steps} "
            f"{took(eval_steps * per_step)}: the run's {evals} evaluations would take ~{share:.0%} of it "
            f"(~{took(evaluating)} of ~{took(evaluating + training)}); eval_steps={fewer} keeps them near a tenth, or "
            "evaluate on fewer rows")  # fmt: skip
