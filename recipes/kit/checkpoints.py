"""Orbax checkpoints of the train state, of every process's data position, and of the
step's logged record.

Every process of a run writes its shards of the state (Orbax) and its own data iterator's
state (Grain's handler: `data/process_<i>-of-<n>.json`). A checkpoint restores on another
number of processes or devices too: Orbax reshards the state onto the new run's mesh, and
since every process's pipeline holds the same position in the global stream (a shard of each
batch, `tunelib.data`'s `shard`), the new processes take that position. The step's record
(what the run logs for it) is saved too: a process killed after the checkpoint but before
the line reached `metrics.jsonl` loses nothing.
"""

import json
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp

from kit.errors import UserError


class Checkpoints:
    """The last two checkpoints of a run, each the train state, the data positions and the
    step's record.

    Orbax writes each step into a temporary folder and renames it into place once complete,
    so a process killed mid-write leaves the last complete checkpoint as the latest.
    """

    def __init__(self, folder: Path):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False, create=True
        )
        self.folder = folder.resolve()
        self.manager = ocp.CheckpointManager(
            self.folder,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
                "record": ocp.JsonCheckpointHandler(),
            },
        )

    def save(self, step: int, state, batches, record: dict) -> None:
        """Save `state`, the position of the Grain iterator `batches` and the step's `record`
        as `step`."""
        if self.manager.latest_step() == step:
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(batches),
                record=ocp.args.JsonSave(record),
            ),
            force=True,
        )

    def restore_latest(self, template, batches) -> tuple[int, object, dict]:
        """`(step, state, record)` of the latest checkpoint, the state placed like `template`;
        `batches` (a fresh Grain iterator of the run's data) is moved to its position."""
        step = self.manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()
                ),
            )
        except ValueError as error:  # another model: Orbax names the first mismatch
            reason = str(error).splitlines()[0].split(" Truncating/padding")[0]
            raise UserError(
                f"--resume: the checkpoint of step {step} in {self.folder} does not fit this "
                f"run's model: {reason}"
            ) from None
        batches.set_state(data_position(self.folder / str(step) / "data"))
        return step, out["state"], out["record"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def data_position(folder: Path) -> dict:
    """This process's data iterator state from a checkpoint's `data/` folder: its own file
    when the run has as many processes as the one that saved it, else the position every
    process of that run shared (a different count of processes can only take that)."""
    index, count = jax.process_index(), jax.process_count()
    own = folder / f"process_{index}-of-{count}.json"
    if own.exists():
        return json.loads(own.read_text())
    states = [json.loads(p.read_text()) for p in sorted(folder.glob("process_*-of-*.json"))]
    if not states:
        raise UserError(f"--resume: {folder} holds no data position")
    if any(state != states[0] for state in states):
        raise UserError(
            f"--resume: the checkpoint in {folder.parent} was saved by {len(states)} processes "
            f"at different data positions (packed rows), so it resumes on {len(states)} "
            f"processes only, not {count}"
        )
    return states[0]
