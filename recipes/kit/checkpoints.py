"""Orbax checkpoints of the train state and the data iterator's position."""

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    """The last two checkpoints of a run, each the train state and the data position.

    Orbax writes each step into a temporary folder and renames it into place once complete,
    so a process killed mid-write leaves the last complete checkpoint as the latest.
    """

    def __init__(self, folder: Path):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False, create=True
        )
        self.manager = ocp.CheckpointManager(folder.resolve(), options=options)

    def save(self, step: int, state, data_state: dict) -> None:
        if self.manager.latest_step() == step:
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )

    def restore_latest(self, template) -> tuple[int, object, dict]:
        """`(step, state, data_state)` of the latest checkpoint, shaped like `template`."""
        step = self.manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        return step, out["state"], out["data"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
