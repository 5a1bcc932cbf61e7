"""Runs a recipe trains first: the SFT start of DPO and GRPO, the teacher of distillation,
the SFT baseline of ORPO.

A chained run is an ordinary run of `recipes/sft.py`, started as its own process with its
own run folder, so it can be inspected, resumed or reused like any other. It is a process,
not a function call, on purpose: recipes never import each other (SFT's step lives in
`recipes/sft.py`, not in the kit), the run is exactly the command a user would type (its
flags checked, its Ctrl-C, its `--resume`), and its devices, compiled programs and memory are
released before the recipe that needs it starts its own. It is trained only
at the default location a recipe owns (`runs/sft-seed<seed>`, ...), never at a path the user
named: a `--model` that does not exist is an error, not a request to train one.

A chained run is trained before the recipe opens its own devices, so a recipe calls
`sft_start` (or `ensure_model`, `baseline`) first, before `kit.parallel.placement` or
anything else that starts JAX's backend: on a TPU host one process at a time can hold the
chips, and the child could not open them while its parent holds them.
"""

import json
import sys
import time
from pathlib import Path

from tunelib import distributed

from kit.children import run_child
from kit.config import VisionTask
from kit.errors import UserError
from kit.models import Model, load_model, model_folder, replicated, with_remat
from kit.runs import default_out

RECIPES = Path(__file__).resolve().parents[1]


def train_sft(out: Path, flags: list[str], *, what: str) -> float:
    """Run `recipes/sft.py --out OUT FLAGS` to the end; its wall time in seconds. Called before
    this process starts JAX's backend (the module's docstring says why)."""
    _alone(what, f"train it first with python -m tunelib.launch -n N recipes/sft.py --out {out}")
    print(f"{what}: training it first with recipes/sft.py --out {out}", flush=True)
    started = time.perf_counter()
    code = run_child([sys.executable, str(RECIPES / "sft.py"), "--out", str(out), *flags])
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise UserError(
            f"{what}: the SFT run in {out} stopped (exit {code}); see its message above"
        )
    return time.perf_counter() - started


def _alone(what: str, advice: str) -> None:
    """A `UserError` in a run of several processes, which starts no other run."""
    if distributed.launched_process_count() > 1:
        raise UserError(f"{what}: a run of several processes starts no other run; {advice}")


def ensure_model(named: Path | None, default_run: Path, flags: list[str], *, what: str):
    """`(model folder, seconds spent training it)`: the named model, or the default run's
    model, trained first (seconds > 0) when that run has none."""
    if named is not None:
        return model_folder(named), None
    if (default_run / "model" / "config.json").is_file():
        return default_run / "model", None
    # An unfinished run there (stopped, killed) is continued: the same flags, resumed.
    flags = [*flags, "--resume", "auto"]
    seconds = train_sft(default_run, flags, what=f"no {what} at {default_run}")
    return default_run / "model", seconds


def result_of(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def sft_flags(config, **values) -> list[str]:
    """Flags of an SFT run on this run's task (seed, problems, operands, log-probs, progress
    bar, plots), with `values` added or replacing them (`steps=2000`, `model_size="student"`)."""
    task = {
        "seed": config.seed, "num_train": config.num_train, "num_heldout": config.num_heldout,
        "max_digits": config.max_digits, "operations": config.operations,
        "logprobs": config.logprobs,
    }  # fmt: skip
    if isinstance(config, VisionTask) and config.task != "arithmetic":  # the vision task
        task.update(task=config.task, image_size=config.image_size, max_count=config.max_count)
        if config.max_distractors is not None:
            task["max_distractors"] = config.max_distractors
    if config.devices is not None:
        task["devices"] = config.devices
    task.update(values)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in task.items()]
    quiet = {"--no-progress": config.no_progress, "--no-plots": config.no_plots}
    return flags + [flag for flag, given in quiet.items() if given]


def sft_start(config) -> tuple[Path, float | None]:
    """The start model of DPO and GRPO: `--model`, or this seed's SFT run (of the vision
    task: `runs/sft-vision_counting-seed<seed>`), trained first (on this run's task, for
    `--sft-steps`) when it is not there."""
    steps = {} if config.sft_steps is None else {"steps": config.sft_steps}
    name = "sft" + (config.task_suffix() if hasattr(config, "task_suffix") else "")
    return ensure_model(
        config.model, default_out(name, config.seed), sft_flags(config, **steps),
        what="SFT model",
    )  # fmt: skip


def start_model(folder: Path, placement, run, *, remat: str) -> Model:
    """The model saved in `folder` (`sft_start`'s), on every device of `placement`, with
    `--remat`; on `--resume`, the same one the run started from (`run`'s
    `check_start_model`)."""
    from tunelib.rollout import fingerprint

    model = replicated(load_model(folder), placement)
    run.check_start_model(folder, int(fingerprint(model.params)))
    return with_remat(model, remat)


def baseline(run, config, *, model_size: str) -> tuple[float, dict]:
    """An SFT run with this run's seed, task and budget in `<run>/baseline`: its seconds and
    its result. A baseline that finished already (a resumed run's) is not trained again,
    one cut short is resumed (`--resume auto`)."""
    flags = sft_flags(
        config, steps=config.steps, learning_rate=config.learning_rate,
        batch_size=config.batch_size, eval_every=config.eval_every, model_size=model_size,
    )  # fmt: skip
    folder = run.path / "baseline"
    _alone("the SFT baseline", "pass --no-baseline")
    run.open(config)  # the baseline lives in the run's folder: locked and made first
    seconds = train_sft(folder, [*flags, "--resume", "auto"], what="the SFT baseline")
    return seconds, result_of(folder)
