"""A folder or glob of shards as one data set (`--train-data 'shards/*.parquet'`): the rows of the
one file they were cut from, in order (against the file read with json directly); the errors
that name the path or the shard and line at fault; and a training run on the shards equal to one
on the file, its loss logged under the folder's name.

Run: python -m pytest tests/test_shards.py
"""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import data_file, export_weights, read_metrics, run_train

from fsdp_embed import training_data

ROWS = [json.loads(line) for line in open(data_file("stsb-train.jsonl"))][:300]


def write_shards(folder, kind, sizes=(100, 120, 80)):
    """ROWS cut in order into shards part-0, part-1, ... of `kind` (jsonl or parquet), the last
    written first: the order the shards are read in is their names', not the folder's."""
    folder.mkdir(parents=True, exist_ok=True)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for i in reversed(range(len(sizes))):
        rows = ROWS[starts[i] : starts[i] + sizes[i]]
        if kind == "jsonl":
            (folder / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{i}.parquet")
    return folder


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
@pytest.mark.parametrize("form", ["glob", "folder"])
def test_shards_load_as_the_rows_of_the_file_in_order(tmp_path, kind, form):
    folder = write_shards(tmp_path / "shards", kind)
    path = str(folder / f"*.{kind}") if form == "glob" else str(folder)
    (folder / "_SUCCESS").write_text("")  # left out, as Spark's markers and checksums are
    (folder / f".part-0.{kind}.crc").write_text("")
    ds = training_data.load_data(path, "train")
    assert ds.to_list() == ROWS
    assert (
        training_data.set_name(path) == "shards"
        and training_data.set_name(data_file("stsb-train.jsonl")) == "stsb-train"
    )


@pytest.mark.quick
def test_a_saved_folder_keeps_its_meaning(tmp_path):
    datasets.Dataset.from_list(ROWS[:10]).save_to_disk(tmp_path / "saved.v2")
    assert training_data.load_data(str(tmp_path / "saved.v2"), "train").to_list() == ROWS[:10]
    assert training_data.set_name(str(tmp_path / "saved.v2")) == "saved"  # its stem, as before shards
    folder = write_shards(tmp_path / "shards.v2", "jsonl")
    assert training_data.set_name(str(folder) + "/") == "shards.v2"
    assert training_data.set_name(str(tmp_path / "data" / "**" / "*.parquet")) == "data"


@pytest.mark.quick
def test_bad_shards_are_named(tmp_path):
    with pytest.raises(ValueError, match="no file matches the pattern"):
        training_data.load_data(str(tmp_path / "none" / "*.parquet"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="a folder with no data files"):
        training_data.load_data(str(tmp_path / "empty"), "train")
    mixed = write_shards(tmp_path / "mixed", "jsonl")
    write_shards(tmp_path / "more", "parquet")
    (tmp_path / "more" / "part-0.parquet").rename(mixed / "part-9.parquet")
    with pytest.raises(
        ValueError, match=r"its files are \.jsonl, \.parquet; the shards of one data set share one"
    ):
        training_data.load_data(str(mixed), "train")
    bad = write_shards(tmp_path / "bad", "jsonl")
    lines = (bad / "part-1.jsonl").read_text().splitlines()
    lines[6] = lines[6][:-1]  # line 7 of the second shard loses its closing brace
    (bad / "part-1.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"part-1\.jsonl: cannot be read as json: line 7 is not valid JSON"):
        training_data.load_data(str(bad / "part-*.jsonl"), "train")
    (bad / "part-1.jsonl").write_bytes(b'{"sentence1": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"part-1\.jsonl: line 1 is not UTF-8 \(byte 0xe9\)"):
        training_data.load_data(str(bad), "train")
    (bad / "part-2.jsonl").write_text("")
    (bad / "part-1.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=r"part-2\.jsonl: the file is empty"):
        training_data.load_data(str(bad), "train")
    columns = write_shards(tmp_path / "columns", "parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "a", "other": "b"}]), columns / "part-1.parquet")
    with pytest.raises(
        ValueError, match=r"part-1\.parquet: columns \['other', 'text'\], but .*part-0\.parquet has \["
    ):
        training_data.load_data(str(columns), "train")


def test_a_run_on_shards_equals_the_run_on_their_files(tmp_path, tiny_model):
    """Two sets, one a glob of Parquet shards and one a folder of JSON Lines shards, against the
    files they were cut from, named alike: the same seed and rows, so the same losses each step
    (each logged under its folder's name), the same evaluation on an --eval-data glob, the same
    --dataset-settings applied by that name, and the same exported weights."""
    whole = tmp_path / "files"
    whole.mkdir()
    for name in ("shards", "pieces"):
        (whole / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    shards, pieces = write_shards(tmp_path / "shards", "parquet"), write_shards(tmp_path / "pieces", "jsonl")
    common = ["--model", tiny_model, "--loss", "cosent", "--max-steps", 4, "--per-device-batch-size", 8]
    common += ["--max-seq-length", 32, "--log-steps", 1, "--eval-steps", 2]
    common += ["--dataset-settings", '{"shards": {"weight": 3, "per_device_batch_size": 4}}']
    run_train(
        [*common, "--train-data", f"{whole}/shards.jsonl,{whole}/pieces.jsonl"]
        + ["--eval-data", f"{whole}/shards.jsonl", "--output-dir", tmp_path / "one"]
    )
    run_train(
        [*common, "--train-data", f"{shards}/*.parquet,{pieces}"]
        + ["--eval-data", f"{shards}/part-*.parquet", "--output-dir", tmp_path / "sharded"]
    )
    one, sharded = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "sharded")
    assert len(one) == 4 and {"loss/shards", "loss/pieces"} <= set().union(*sharded)
    for row_one, row_sharded in zip(one, sharded, strict=True):
        assert {k: v for k, v in row_one.items() if k.startswith("loss")} == {
            k: v for k, v in row_sharded.items() if k.startswith("loss")
        }
    evals = [
        [r["eval"] for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "eval" in r]
        for run in ("one", "sharded")
    ]
    assert evals[0] == evals[1] and len(evals[0]) == 2 and "shards/spearman" in str(evals[0])
    config = json.loads((tmp_path / "sharded" / "final" / "training_config.json").read_text())
    assert [s["name"] for s in config["train_sets"]] == ["shards", "pieces"]
    weights_one, weights_sharded = (
        export_weights(tmp_path / "one" / "final"),
        export_weights(tmp_path / "sharded" / "final"),
    )
    assert weights_one.keys() == weights_sharded.keys()
    assert all(torch.equal(weights_one[k], weights_sharded[k]) for k in weights_one)
