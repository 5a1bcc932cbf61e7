"""`benchmarks/sampler_smollm2.py` at its smallest settings on a tiny GGUF file the test
writes (`--model`), and its pure helpers: the mismatch report, the prompts, the flags.

The real SmolLM2 file (`tests/models/test_smollm2.py` covers it) takes two minutes to load into
both sides; the tiny file takes well under a second, and runs the script's whole path: the
same loaders, the chat template rendered by transformers' GGUF tokenizer, the check, the
timing and the report."""

import json

import numpy as np
import pytest

from tests._gguf import TOKENIZER_SIZE, write_tiny_gguf
from tests._hf import hf_modules
from tests.benchmarks._run import load_benchmark
from tunelib.data import render_chat_template
from tunelib.formats import gguf_tokenizer


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sampler_smollm2.py", "sampler_smollm2_benchmark")


@pytest.mark.slow
def test_smallest_settings_check_the_tokens_then_time_both_sides(bench, tmp_path, capsys):
    hf_modules()
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", bench.MESSAGES)
    out = tmp_path / "result.json"
    argv = ["--model", str(tiny), "--batches", "2", "--new-tokens", "4", "--repeats", "1"]
    code = bench.main([*argv, "--json-out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, "\n".join(lines[-10:])
    result = json.loads(lines[-1])
    assert result == json.loads(out.read_text())

    # The check ran before the timing, and tunelib's greedy tokens equal generate's.
    assert result["tokens_agree"] is True and result["mismatches"] == {} and result["timed"]
    assert "greedy tokens of tunelib == transformers' at every batch: pass" in lines
    case = result["case"]
    assert case["model"] == "tiny.gguf"
    assert (case["layers"], case["hidden"], case["vocab"]) == (2, 64, TOKENIZER_SIZE)
    assert (case["new_tokens"], case["batches"], case["dtype"]) == (4, [2], "float32")
    assert case["backend"] == "cpu" and case["torch_threads"] >= 1 and case["scan_layers"]
    assert (case["layout"], case["products"]) == ("per_layer", "blocked")
    assert set(case["cpu"]) == {"model", "avx512"} and case["cpu"]["model"]
    assert set(result["versions"]) == {"jax", "jaxlib", "torch", "transformers"}
    assert all(result["versions"].values())

    (row,) = result["batches"]
    assert row["batch"] == 2 and row["tokens"] == 8 and row["tokens_agree"]
    # The longer of the two prompts as tunelib renders and encodes them: transformers' GGUF
    # tokenizer applied the file's template as tunelib does.
    ours = gguf_tokenizer(tiny)
    lengths = [
        len(ours.encode(render_chat_template(
            ours.chat_template, [{"role": "user", "content": message}],
            add_generation_prompt=True, **ours.special_tokens,
        )))
        for message in bench.MESSAGES[:2]
    ]  # fmt: skip
    assert row["prompt_len"] == int(case["prompt_lens"]["2"]) == max(lengths) > 30
    for side in ("tunelib", "transformers"):
        r = row[side]
        assert len(r["runs_s"]) == 1 and r["median_s"] == r["runs_s"][0] > 0
        assert r["tokens_per_s"] == pytest.approx(8 / r["median_s"])
        assert result["tokens_per_s"][side] == {"2": r["tokens_per_s"]}
        # The split: the N=1 call is the prefill, the rest of the N=4 call three decode steps.
        assert r["prefill_s"] == r["prefill_runs_s"][0] > 0
        decode_ms = 1e3 * (r["median_s"] - r["prefill_s"]) / 3
        assert r["decode_ms_per_step"] == pytest.approx(decode_ms)
    tunelib = row["tunelib"]
    assert 0 < tunelib["compile_s"] < tunelib["first_call_s"]
    assert tunelib["prefill_compile_s"] > 0
    assert result["compile_s"] == {"2": tunelib["compile_s"]}
    assert row["transformers"]["compile_s"] is None

    expected = row["transformers"]["median_s"] / tunelib["median_s"]
    assert (
        result["ratio"] == {"2": pytest.approx(expected)} and row["ratio"] == result["ratio"]["2"]
    )
    assert row["ratio"] == pytest.approx(
        tunelib["tokens_per_s"] / row["transformers"]["tokens_per_s"]
    )
    assert row["ratio_by_round"] == [pytest.approx(expected)]
    assert result["meets_targets"] == {
        "ratio>=1 at every batch": row["ratio"] >= 1,
        "ratio>=2 at batch 32": None,  # batch 32 not run
    }
    header = next(line for line in lines if line.lstrip().startswith("batch"))
    for column in ("tunelib tok/s", "transformers tok/s", "ratio", "compile s"):
        assert column in header


def test_first_difference_names_the_first_differing_row_and_token(bench):
    ours = np.array([[5, 6, 7], [1, 2, 3], [4, 4, 4]])
    assert bench.first_difference(ours, ours.copy()) is None
    theirs = ours.copy()
    theirs[1, 2], theirs[2, 0] = 9, 8
    mismatch = bench.first_difference(ours, theirs)
    assert mismatch == {
        "rows_differing": 2, "rows": 3, "row": 1, "position": 2,
        "tunelib_token": 3, "transformers_token": 9,
    }  # fmt: skip
    text = bench.describe(mismatch | {"margins": {"tunelib": 2e-6, "transformers": -3e-6}})
    assert "2 of 3 rows differ; first at row 1, new token 2: tunelib 3, transformers 9" in text
    assert "2e-06 in tunelib, -3e-06 in transformers" in text
    shapes = bench.first_difference(ours, theirs[:, :2])
    assert bench.describe(shapes) == "tunelib's tokens have shape [3, 3], transformers' [3, 2]"


class _Tokenizer:
    """Renders a chat as one id per character of its user message."""

    def apply_chat_template(self, chat, *, add_generation_prompt):
        assert add_generation_prompt
        (turn,) = chat
        return [ord(c) for c in turn["content"]]


def test_prompts_cycle_the_messages_and_pad_on_the_left(bench):
    messages = bench.MESSAGES
    batch = len(messages) + 1
    tokens, where = bench.prompts(_Tokenizer(), batch)
    width = max(len(m) for m in messages)
    assert tokens.shape == where.shape == (batch, width) and tokens.dtype == np.int32
    for row in range(batch):
        message = messages[row % len(messages)]
        assert where[row].sum() == len(message) and where[row, -len(message) :].all()
        assert list(tokens[row][where[row]]) == [ord(c) for c in message]
        assert (tokens[row][~where[row]] == bench.PAD).all()
    assert list(tokens[-1]) == list(tokens[0])  # the 33rd row is the first message again
    assert len(set(messages)) == len(messages) == 32
    first_two = bench.prompts(_Tokenizer(), 2)[1]
    assert not first_two.all()  # even a batch of 2 is padded


@pytest.mark.parametrize("text", ["1,1", "0,8", "8,x", ""])
def test_bad_batches_are_refused_before_anything_loads(bench, text, capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--batches", text])
    assert "--batches" in capsys.readouterr().err


def test_a_model_that_is_not_a_gguf_file_is_refused_before_anything_loads(bench, tmp_path):
    assert bench.build_parser().parse_args([]).model is None  # the installed SmolLM2 file
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"")
    for path in (tmp_path / "missing.gguf", tmp_path, other):
        with pytest.raises(SystemExit, match=r"^--model must be an existing \.gguf file, got "):
            bench.main(["--model", str(path)])


def test_batches_parse_in_the_given_order(bench):
    assert bench.build_parser().parse_args([]).batches == (1, 8, 32)
    assert bench.build_parser().parse_args(["--batches", "32,1"]).batches == (32, 1)


def test_a_mismatch_is_reported_and_nothing_is_timed(bench):
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=30, hidden_size=576, vocab_size=49152)
    models = SimpleNamespace(checkpoint=SimpleNamespace(config=config))
    args = bench.build_parser().parse_args(["--batches", "1,8"])
    mismatch = {
        "rows_differing": 1, "rows": 1, "row": 0, "position": 5,
        "tunelib_token": 3, "transformers_token": 9,
        "margins": {"tunelib": 1e-6, "transformers": -2e-6},
    }  # fmt: skip
    measured = {"checks": {1: mismatch}, "prompt_lens": {1: 40}}  # stopped at batch 1
    result = bench.summarise(args, bench.model_file(), models, measured)
    assert result["tokens_agree"] is False and result["timed"] is False
    assert result["mismatches"] == {"1": mismatch} and "ratio" not in result
    text = bench.report(result)
    assert "greedy tokens at batch 1 DIFFER: 1 of 1 rows differ; first at row 0" in text
    assert text.endswith("nothing timed (--allow-mismatch times anyway)")
    json.dumps(result)
