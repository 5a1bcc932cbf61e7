"""`save_hf_checkpoint` called by every process of a run whose parameters are spread over
the processes: one checkpoint, written by process 0, equal to a one-process save."""

import subprocess
import sys
import textwrap

import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from tunelib.formats import save_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig

CONFIG = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
}  # fmt: skip

PROGRAM = f"""
import sys
import jax, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tunelib import distributed
from tunelib.formats import save_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig

runtime = distributed.initialize()
mesh = jax.make_mesh((len(runtime.devices),), ("data",),
                     axis_types=(jax.sharding.AxisType.Auto,))
graphdef, state = nnx.split(Decoder(DecoderConfig(**{CONFIG!r}), rngs=nnx.Rngs(0)))
params = nnx.to_pure_dict(state)

def spread(x):  # rows split over every process's devices where they divide, else copies
    x = np.asarray(x)
    spec = P("data") if x.ndim and x.shape[0] % len(runtime.devices) == 0 else P()
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

params = jax.tree.map(spread, params)
assert not all(x.is_fully_addressable for x in jax.tree.leaves(params))
out = save_hf_checkpoint(sys.argv[1], graphdef, params, model_type="llama")
print("saved", runtime.process_index, sorted(p.name for p in out.iterdir()))
"""


def test_every_process_saves_one_checkpoint_equal_to_a_single_process_save(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    spread = tmp_path / "spread"
    done = subprocess.run(
        [sys.executable, "-m", "tunelib.launch", "-n", "2", "--devices-per-process", "2",
         str(script), str(spread)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Both processes returned once the folder was complete (process 0 wrote it alone).
    saved = sorted(line for line in done.stdout.splitlines() if "saved" in line)
    files = "['config.json', 'model.safetensors']"
    assert saved == [f"[0] saved 0 {files}", f"[1] saved 1 {files}"], done.stdout[-3000:]

    graphdef, state = nnx.split(Decoder(DecoderConfig(**CONFIG), rngs=nnx.Rngs(0)))
    alone = save_hf_checkpoint(tmp_path / "alone", graphdef, state, model_type="llama")
    got, want = load_file(spread / "model.safetensors"), load_file(alone / "model.safetensors")
    assert got.keys() == want.keys() and len(got) > 5
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (spread / "config.json").read_text() == (alone / "config.json").read_text()
