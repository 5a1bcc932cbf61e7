"""Where a run's metrics go: JSON lines always, TensorBoard and Weights & Biases on request.

Every writer takes one record per step, `{"step": n, "loss": ..., ...}`, and `--log-to`
picks the writers (`jsonl`, `tensorboard`, `wandb`). `metrics.jsonl` is always written: the
result line, the plots and `--resume` read it back.
"""

import dataclasses
from pathlib import Path
from typing import Protocol

from kit.errors import UserError
from kit.runs import to_json


class Writer(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonLines:
    """`metrics.jsonl`: one JSON object per line, appended as the run goes, each line handed
    to the system as it is written (a killed run keeps every step it logged). The file stays
    open while the run lasts: opening and closing it for each line took 2.2 ms on a TPU VM, a
    tenth of the toy SFT's run (`docs/tpu.md`)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def write(self, record: dict) -> None:
        if self.file is None:
            self.file = self.path.open("a")
        self.file.write(to_json(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoard:
    """Event files in `<run>/tensorboard/` (`tensorboard --logdir runs/`)."""

    def __init__(self, folder: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run in `<run>/wandb/`, with the configuration attached.

    The mode comes from `WANDB_MODE` (`offline` writes locally; `wandb sync` uploads later).
    """

    def __init__(self, folder: Path, name: str, config: object):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        values = {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()
        }
        try:
            self.run = wandb.init(project="tunelib", name=name, dir=str(folder), config=values)
        except wandb.errors.Error as error:  # not logged in, the server out of reach, ...
            raise UserError(
                f"--log-to wandb: {str(error).strip()} (or set WANDB_MODE=offline to keep the "
                "run here, and upload it later with wandb sync)"
            ) from None

    def write(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_writers(run_folder: Path, name: str, config) -> list[Writer]:
    """The writers `config.log_to` asks for; JSON lines first and always."""
    writers: list[Writer] = [JsonLines(run_folder / "metrics.jsonl")]
    targets = config.log_targets()
    if "tensorboard" in targets:
        writers.append(TensorBoard(run_folder / "tensorboard"))
    if "wandb" in targets:
        writers.append(WandB(run_folder / "wandb", name, config))
    return writers
