"""The whole Hugging Face path a recipe takes: checkpoint and JSON lines in, fine-tuned checkpoint
out, loaded by transformers."""

import jax
import numpy as np
import optax
from flax import nnx

from tests._hf import hf_logits, hf_modules, write_chat_jsonl, write_tiny_checkpoint
from tunelib.data import HFTokenizer, encode_chat, read_records, sft_dataset
from tunelib.formats import load_hf_checkpoint, save_hf_checkpoint
from tunelib.logprobs import token_logps


def test_fine_tune_a_checkpoint_on_chat_records_and_load_it_in_transformers(tmp_path):
    _, transformers = hf_modules()
    source = write_tiny_checkpoint(tmp_path / "model", "qwen2", seed=1)
    data = write_chat_jsonl(tmp_path / "data.jsonl", 12)

    checkpoint = load_hf_checkpoint(source)
    graphdef, params = checkpoint.graphdef, checkpoint.params
    tokenizer = HFTokenizer.from_directory(source)
    records, report = read_records(data, kind="sft")
    assert report.kept == 12
    batches = iter(sft_dataset(records, tokenizer, max_length=128, batch_size=4, seed=0))

    optimizer = optax.adam(3e-3)

    @jax.jit
    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        hidden = model(batch["tokens"], where=batch["attention_where"])
        logps = token_logps(model.unembed(hidden), batch["targets"], where=batch["where"])
        return -logps.sum() / batch["where"].sum()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    fixed = next(batches)
    first = float(loss_fn(params, fixed))
    for _ in range(8):
        params, opt_state, _ = step(params, opt_state, next(batches))
    assert float(loss_fn(params, fixed)) < first - 0.5  # it learned the answers' format

    out = save_hf_checkpoint(tmp_path / "tuned", graphdef, params,
                             hf_config=checkpoint.hf_config, copy_files_from=source)  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reference).__name__ == "Qwen2ForCausalLM"
    tokens, where = fixed["tokens"], fixed["attention_where"]

    @jax.jit
    def logits(params):
        model = nnx.merge(graphdef, params)
        return model.unembed(model(tokens, where=where))

    ours = np.asarray(logits(params))
    assert np.abs(hf_logits(reference, tokens, where) - ours)[where].max() < 1e-4
    # The copied tokenizer files make the checkpoint complete for transformers too.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = records[0]["messages"]
    expected = hf_tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]
    assert encode_chat(HFTokenizer.from_directory(out), messages)[0].tolist() == expected
