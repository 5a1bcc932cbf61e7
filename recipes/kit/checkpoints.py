"""Orbax checkpoints of the train state, of every process's data position, and of the
step's logged record.

Every process of a run writes its shards of the state (Orbax) and its own data iterator's
state (Grain's handler: `data/process_<i>-of-<n>.json`). A checkpoint restores on another
number of processes or devices too: Orbax reshards the state onto the new run's mesh, and
since every process's pipeline holds the same position in the global stream (a shard of each
batch, `tunelib.data`'s `shard`), the new processes take that position. The step's record
(what the run logs for it) is saved too: a process killed after the checkpoint but before
the line reached `metrics.jsonl` loses nothing.

An asynchronous checkpoint (Orbax's async checkpointing) is copied off the devices and its
data position and record written in the step, and its arrays are written by a background
thread while training goes on; `close` waits for it. It is renamed into place
once every file is written, so a process killed meanwhile leaves the previous checkpoint as
the latest.
"""

import json
import logging
import sys
from pathlib import Path

import grain
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from tunelib.distributed import FaultPlan

from kit.errors import UserError
from kit.restores import quiet_restore


class Checkpoints:
    """The last two checkpoints of a run, each the train state, the data positions and the
    step's record.

    Orbax writes each step into a temporary folder and renames it into place once complete,
    so a process killed mid-write leaves the last complete checkpoint as the latest; a
    complete one damaged later (a file cut short) is skipped on restore. With
    `asynchronous`, `save` returns once the state is off the devices, and the files are
    written while training goes on.
    """

    def __init__(self, folder: Path, *, asynchronous: bool = False, faults=None):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=asynchronous, create=True
        )
        self.folder = folder.resolve()
        # The injected faults (`tunelib.distributed.FaultPlan`; TUNELIB_FAULTS by default).
        self.faults = faults if faults is not None else FaultPlan.from_environment()
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
        with self.faults.during("checkpoint", step, written=self.folder):
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
        """`(step, state, record)` of the latest intact checkpoint, the state placed like
        `template`; `batches` (a fresh Grain iterator of the run's data) is moved to its
        position.

        A checkpoint that cannot be read (a file cut short or damaged) is skipped for the
        one before it, with one line saying which and why, and moved aside to
        `damaged-<step>/` so the run can save that step again; with none intact, or one
        of other shapes (another model behind the same settings), a `UserError`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        damaged = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            other = shape_mismatch(self.folder / str(step) / "state", abstract)
            if other is not None:
                raise UserError(
                    f"--resume: the checkpoint of step {step} in {self.folder} does not fit "
                    f"this run's model: {other}"
                )
            restored, reason = self._restore(step, abstract, batches)
            if restored is not None:
                self._set_aside(damaged, step)
                return step, restored["state"], restored["record"]
            if _other_shapes(reason):
                raise UserError(
                    f"--resume: the checkpoint of step {step} in {self.folder} does not fit "
                    f"this run's model: {reason}"
                )
            damaged.append((step, reason))
        found = "; ".join(f"step {step}: {reason}" for step, reason in damaged)
        raise UserError(
            f"--resume: no checkpoint in {self.folder} is intact ({found or 'none saved'}); "
            "start the run again with --overwrite"
        )

    def _restore(self, step: int, abstract, batches) -> tuple[dict | None, str]:
        """The state and record of `step` with `batches` at its position, and "", or None and
        the first line of why it cannot be read."""
        # Without its metadata Orbax reads the state as a tree of another structure, which
        # would be taken for a checkpoint of another model.
        if not (self.folder / str(step) / "state" / "_METADATA").is_file():
            return None, "its state/_METADATA is missing"
        try:
            with quiet_restore():
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()
                    ),
                )
            batches.set_state(data_position(self.folder / str(step) / "data"))
        except UserError:  # the data positions of another count of processes
            raise
        except Exception as error:  # a file Orbax, TensorStore or JSON cannot read
            return None, unreadable(error)
        return out, ""

    def _set_aside(self, damaged: list[tuple[int, str]], restored: int) -> None:
        """Say which checkpoints were skipped for `restored`, and move them aside (process 0,
        once every process has restored)."""
        if not damaged:
            return
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("checkpoint restored")
        if jax.process_index() == 0:
            for step, reason in damaged:
                aside = self.folder / f"damaged-{step}"
                (self.folder / str(step)).rename(aside)
                print(
                    f"--resume: the checkpoint of step {step} is damaged ({reason}), moved "
                    f"to {aside}; resuming from step {restored}, the latest intact one",
                    file=sys.stderr,
                    flush=True,
                )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("damaged checkpoints set aside")
        self.manager.reload()

    def close(self) -> None:
        """Wait for the checkpoint being written, if any, then close."""
        self.manager.wait_until_finished()
        self.manager.close()


def unreadable(error: Exception) -> str:
    """The first line of why Orbax, TensorStore or JSON could not read a checkpoint, without
    Orbax's padding advice or TensorStore's spec; `error` raised again when the device ran
    out of memory (the files may be fine). Where Orbax only says which part of an array it
    failed to read, TensorStore's reason (the file, the array and what is wrong) is given.
    """
    if "RESOURCE_EXHAUSTED" in str(error):
        raise error
    reason = _first_line(error)
    if reason.startswith("Encountered error while reading array index") and error.__cause__:
        reason = _first_line(error.__cause__)
    for tail in (" Truncating/padding", " [tensorstore_spec", " See full TensorStore details"):
        reason = reason.split(tail)[0]
    return reason[:300]


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Traceback (most recent")]
    return lines[0] if lines else type(error).__name__


def shape_mismatch(folder: Path, template) -> str | None:
    """The first array of `template` stored in the Orbax checkpoint `folder` with another
    shape, as one line, or None. Read from the checkpoint's metadata before restoring: a
    restore that fails on a shape leaves TensorStore reads behind it, which print
    tracebacks ("Event loop is closed") as the process exits. Arrays the metadata does not
    name alike, or a checkpoint without metadata, are left to the restore."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns of metadata it cannot read: the restore says
    try:
        with quiet_restore(), ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(folder).item_metadata.tree
    except Exception:  # no or damaged metadata: the restore says what is wrong
        return None
    finally:
        absl.setLevel(level)
    if stored is None:
        return None
    shapes = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(stored)
        if hasattr(leaf, "shape")
    }
    for path, leaf in jax.tree_util.tree_leaves_with_path(template):
        name = jax.tree_util.keystr(path)
        if name in shapes and shapes[name] != tuple(leaf.shape):
            return f"{name} has shape {shapes[name]} there and {tuple(leaf.shape)} here"
    return None


def _other_shapes(reason: str) -> bool:
    """Whether Orbax's reason for not restoring is a state of other shapes or structure (a
    checkpoint of another model), not a damaged file."""
    return "not compatible with the stored shape" in reason or "tree structure" in reason


def data_position(folder: Path) -> dict:
    """This process's data iterator state from a checkpoint's `data/` folder: its own file
    when the run has as many processes as the one that saved it, else the position every
    process of that run shared (a different count of processes can only take that); a
    `FileNotFoundError` when it holds none."""
    index, count = jax.process_index(), jax.process_count()
    own = folder / f"process_{index}-of-{count}.json"
    if own.exists():
        return json.loads(own.read_text())
    states = [json.loads(p.read_text()) for p in sorted(folder.glob("process_*-of-*.json"))]
    if not states:  # a damaged checkpoint: the one before it is restored instead
        raise FileNotFoundError(f"{folder} holds no data position")
    if any(state != states[0] for state in states):
        raise UserError(
            f"--resume: the checkpoint in {folder.parent} was saved by {len(states)} processes "
            f"at different data positions (packed rows), so it resumes on {len(states)} "
            f"processes only, not {count}"
        )
    return states[0]
