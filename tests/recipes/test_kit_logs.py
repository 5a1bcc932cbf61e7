"""The run's metric writers: `metrics.jsonl` is readable line by line while the run writes."""

import json

import tests.recipes._scripts  # noqa: F401 (puts recipes/ on the path)

from kit import logs


def test_every_line_is_in_the_file_as_soon_as_it_is_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 2.0}) + "\n")  # a resumed run's records
    writer = logs.JsonLines(path)
    for step in (1, 2):
        writer.write({"step": step, "loss": 1.0 / step})
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(step + 1))  # before any close
    writer.close()
    writer.close()  # a second close (an error path after the loop's) is harmless
    writer.write({"step": 3, "loss": 0.3})  # reopened, appended
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
