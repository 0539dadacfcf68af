"""Every setting the flags accept trains, or is refused in one line: a matrix made from the parser.

The factors are the full trainer's own flags, their values read from its parser (config.Config):
a flag's `choices`, on and off for a boolean, one small value beside the default for a number,
so a choice added to a flag joins the matrix without anyone adding it here:
  model x pooling   a tiny random BERT, a tiny Qwen2 (with --append-eos) or a tiny BERT masked LM,
                    with --pooling's choices (splade: the masked LM's head);
  precision         --precision's choices;
  strategy          one process, DDP, and FSDP at each --fsdp-version x each --sharding;
  loss              config.LOSS_NAMES, each on rows of its own columns;
  path options      --gather-negatives, --cache-chunk-size, --packing, --matryoshka-dims,
                    --lora-rank, --activation-checkpointing, --mask-duplicates,
                    --inference-free-queries.
`all_pairs` builds runs in which every pair of values of two factors meets at least once
(pairwise design, greedy), leaving out what REFUSALS says cannot work; each refusal is then run
once on its own. Each run takes 2 steps and exports, and must end in one of two ways:
  trained: exit 0 on every rank, and the export loads in sentence-transformers (SentenceTransformer,
           SparseEncoder for SPLADE, MultiVectorEncoder for multivector) with vectors for two texts
           equal (1e-5 of the largest) to the trained weights' in the trainer's own model, built with
           the run's flags (a pooling the export names wrongly fails this, not only a NaN);
  refused: before the weights load (the run's record, printed once they have, is not), every
           rank exits non-zero, with one `error:` line naming the conflicting flags, no traceback,
           and no final/ folder.
`--fixed` runs the suite's fixed part instead (tests/test_flag_matrix.py): pooling x precision x
strategy, and the losses of each precision against the fp32 run on the same rows.

Run (about 2 minutes on 2 CPU cores; every run is launched warm, by tests/warm_launcher.py):
    python bench/bench_flag_matrix.py             # the pairwise matrix, then each refusal
    python bench/bench_flag_matrix.py --list      # the runs it would make, and their number
    python bench/bench_flag_matrix.py --fixed     # the suite's fixed part
"""

import argparse
import dataclasses
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_DIR), str(REPO_DIR / "tests")]

from fsdp_embed import config  # noqa: E402  (the standard library alone: --help stays quick)

TEXTS = ["A man is playing a guitar on a stage.", "Two dogs run through a field."]


def field(name):
    return next(f for f in dataclasses.fields(config.Config) if f.name == name)


def values_of(name, small=None):
    """A flag's values as the parser accepts them, the default first: its choices (but "", which
    leaves the choice to the model's folder), on/off for a boolean, else the default and `small`."""
    f = field(name)
    choices = f.metadata["argparse"].get("choices")
    if choices:
        return sorted((c for c in choices if c != ""), key=lambda c: c != f.default)
    if f.type in (bool, "bool"):
        return [False, True]
    return [f.default, small]


def factors():
    """{factor: [values]}: the matrix's factors, from the parser."""
    strategies = ["single", "ddp"] + [
        f"fsdp{version}:{sharding}"
        for version in values_of("fsdp_version")
        for sharding in field("sharding").metadata["argparse"]["choices"]
    ]
    return {
        "model": ["encoder", "decoder", "masked_lm"],
        "pooling": values_of("pooling"),
        "precision": values_of("precision"),
        "strategy": strategies,
        "loss": list(config.LOSS_NAMES),
        "gather_negatives": values_of("gather_negatives"),
        "cache_chunk_size": values_of("cache_chunk_size", small=2),
        "packing": values_of("packing"),
        "matryoshka_dims": values_of("matryoshka_dims", small="32,16"),
        "lora_rank": values_of("lora_rank", small=4),
        "activation_checkpointing": values_of("activation_checkpointing"),
        "mask_duplicates": values_of("mask_duplicates"),
        "inference_free_queries": values_of("inference_free_queries"),
    }


# What cannot work: (a test of a run's values, the words its `error:` line must hold, the
# smallest change of the defaults that meets it). The matrix leaves these out; each is run once,
# the defaults so changed, and must be refused.
MNRL_ONLY = "works on MNRL's candidates"  # --gather-negatives, --mask-duplicates: MNRL's options
REFUSALS = [
    # SPLADE's vocabulary-sized vectors come from a masked LM's head (an encoder's is made from its
    # word embeddings, as sentence-transformers' SparseEncoder makes it); a decoder has none
    (
        lambda c: c.get("pooling") == "splade" and c.get("model") == "decoder",
        "--pooling splade",
        {"model": "decoder", "pooling": "splade"},
    ),
    # FSDP2 has no unsharded mode (DDP is that)
    (lambda c: c.get("strategy") == "fsdp2:no_shard", "no_shard", {"strategy": "fsdp2:no_shard"}),
    (
        lambda c: c.get("gather_negatives") and c.get("loss", "mnrl") != "mnrl",
        MNRL_ONLY,
        {"gather_negatives": True, "loss": "cosent"},
    ),
    (
        lambda c: c.get("mask_duplicates") and c.get("loss", "mnrl") != "mnrl",
        MNRL_ONLY,
        {"mask_duplicates": True, "loss": "margin_mse"},
    ),
    # the Softmax head reads embeddings of one size
    (
        lambda c: c.get("matryoshka_dims") and c.get("loss") == "softmax",
        "--matryoshka-dims",
        {"matryoshka_dims": "32,16", "loss": "softmax"},
    ),
    # a SPLADE model's dimensions are vocabulary entries, in no order
    (
        lambda c: c.get("matryoshka_dims") and c.get("pooling") == "splade",
        "--matryoshka-dims",
        {"model": "masked_lm", "pooling": "splade", "matryoshka_dims": "32,16"},
    ),
    # docs/sparse.md "Not yet": sparse losses but SpladeLoss around MNRL, MarginMSE and DistillKL,
    # MNRL's options with SPLADE
    (
        lambda c: c.get("pooling") == "splade" and c.get("loss", "mnrl") not in SPARSE_LOSSES,
        "--loss",
        {"model": "masked_lm", "pooling": "splade", "loss": "cosent"},
    ),
    (
        lambda c: c.get("pooling") == "splade" and c.get("mask_duplicates"),
        "--mask-duplicates",
        {"model": "masked_lm", "pooling": "splade", "mask_duplicates": True},
    ),
    # inference-free SPLADE (docs/sparse.md): static queries are a SPLADE model's, and GradCache
    # does not run their route
    (
        lambda c: c.get("inference_free_queries") and c.get("pooling") != "splade",
        "--inference-free-queries",
        {"inference_free_queries": True},
    ),
    (
        lambda c: c.get("inference_free_queries") and c.get("cache_chunk_size"),
        "--cache-chunk-size",
        {"model": "masked_lm", "pooling": "splade", "inference_free_queries": True, "cache_chunk_size": 2},
    ),
    # a multi-vector (ColBERT) model: the losses sentence-transformers has a MultiVector form of
    # (MNRL, MarginMSE, DistillKL); one vector a text is what CoSENT, Softmax and MSE compare
    (
        lambda c: c.get("pooling") == "multivector" and c.get("loss", "mnrl") not in MULTI_VECTOR_LOSSES,
        "multi-vector",
        {"pooling": "multivector", "loss": "cosent"},
    ),
    # docs/multivector.md "Not yet": Matryoshka token vectors, MNRL's options with MaxSim
    (
        lambda c: c.get("pooling") == "multivector" and c.get("matryoshka_dims"),
        "--matryoshka-dims",
        {"pooling": "multivector", "matryoshka_dims": "32,16"},
    ),
    (
        lambda c: c.get("pooling") == "multivector" and c.get("mask_duplicates"),
        "--mask-duplicates",
        {"pooling": "multivector", "mask_duplicates": True},
    ),
]
MULTI_VECTOR_LOSSES = ("mnrl", "margin_mse", "distill_kl")
SPARSE_LOSSES = ("mnrl", "margin_mse", "distill_kl")  # SpladeLoss around their Sparse forms
# (the bench's own expectation, kept apart from model_checks' lists it checks)


def refused(case):
    return next((words for test, words, _ in REFUSALS if test(case)), None)


def defaults():
    """The run of every factor's first value (the flag's default): one that trains."""
    return {name: values[0] for name, values in factors().items()}


def refusal_runs():
    """One run for each refusal: the defaults with the refusal's change, and the error's words."""
    return [({**defaults(), **change}, words) for _, words, change in REFUSALS]


def all_pairs(factors, allowed=lambda case: True):
    """Runs (dicts) in which every pair of values of two factors that some allowed run can hold
    meets at least once. Greedy: each new run starts from the first pair not met yet and takes,
    factor by factor, the allowed value that meets most pairs not met yet (ties: the earlier value,
    the default first), so the design is the same every time."""
    names = list(factors)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in factors[a]
        for vb in factors[b]
    }
    runs = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), str(p)))
        case = {a: va, b: vb}
        for name in names:
            if name in case:
                continue
            best = max(
                factors[name],
                key=lambda v: (
                    allowed({**case, name: v}),
                    sum(
                        ((n, case[n]), (name, v)) in uncovered or ((name, v), (n, case[n])) in uncovered
                        for n in case
                    ),
                ),
            )
            case[name] = best
        if not allowed(case):  # the seed pair cannot meet in a run that works
            uncovered.discard(((a, va), (b, vb)))
            continue
        runs.append(case)
        for (n1, v1), (n2, v2) in itertools.combinations([(n, case[n]) for n in names], 2):
            uncovered.discard(((n1, v1), (n2, v2)))
    return runs


def write_data(folder, num_rows=32):
    """{loss: file} with `num_rows` rows of each loss's columns, from the public sets in data/."""
    import conftest  # the tests' helpers: the warm launcher, the tiny decoder, the model loader
    import torch

    def read(name):
        with open(conftest.data_file(name)) as f:
            return [json.loads(line) for line in f][:num_rows]

    triplets = read("sick-triplets-train.jsonl")
    gen = torch.Generator().manual_seed(0)
    rows = {
        "mnrl": triplets,
        "cosent": read("stsb-train.jsonl"),
        "softmax": read("sick-nli-train.jsonl"),
        "margin_mse": [
            {
                "query": r["anchor"],
                "positive": r["positive"],
                "negative": r["negative"],
                "label": 1 + i % 5 / 2,
            }
            for i, r in enumerate(triplets)
        ],
        "distill_kl": [
            {
                "query": r["anchor"],
                "positive": r["positive"],
                "negative": r["negative"],
                "scores": [5.0 + i % 3, 1.0 + i % 4],
            }
            for i, r in enumerate(triplets)
        ],
        "mse": [
            {"text": r["anchor"], "embedding": torch.randn(64, generator=gen).tolist()} for r in triplets
        ],
    }
    files = {}
    for loss, loss_rows in rows.items():
        files[loss] = Path(folder) / f"{loss}.jsonl"
        files[loss].write_text("".join(json.dumps(r) + "\n" for r in loss_rows))
    return files


def write_models(folder):
    """{model: folder}: a tiny random BERT encoder, Qwen2 decoder and BERT masked LM (2 layers, 64
    dims). The BERTs share a WordPiece tokenizer trained here on real sentences (1,000 entries:
    a SPLADE head over all-MiniLM-L6-v2's 30,522 would take most of each run's time)."""
    import conftest
    import torch
    import transformers

    from tokenizers import BertWordPieceTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(conftest.sentences(), vocab_size=1000)
    wordpiece.save_model(str(folder))
    tokenizer = transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt"))
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**sizes), add_pooling_layer=False).save_pretrained(
        folder / "encoder"
    )
    transformers.BertForMaskedLM(transformers.BertConfig(**sizes)).save_pretrained(folder / "masked_lm")
    for name in ("encoder", "masked_lm"):
        tokenizer.save_pretrained(folder / name)
    conftest.tiny_decoder(folder / "decoder")
    return {name: folder / name for name in ("encoder", "decoder", "masked_lm")}


def launch(case, models, data, out):
    """(args, nproc) of the run `case`: 2 steps of 8 rows (4 a rank at world 2: the same rows at
    any world size), logged every step, then the export."""
    args = ["--model", models[case["model"]], "--pooling", case["pooling"], "--loss", case["loss"]]
    args += ["--train-data", data[case["loss"]], "--precision", case["precision"]]
    strategy = case["strategy"]
    nproc = 1 if strategy == "single" else 2
    args += ["--max-steps", 2, "--per-device-batch-size", 8 // nproc, "--max-seq-length", 24, "--lr", 1e-4]
    args += ["--dropout", 0, "--log-steps", 1, "--output-dir", out]
    if strategy in ("single", "ddp"):
        args += ["--strategy", strategy]
    else:
        version, sharding = strategy.removeprefix("fsdp").split(":")
        args += ["--strategy", "fsdp", "--fsdp-version", version, "--sharding", sharding]
    if case["model"] == "decoder":
        args += ["--append-eos"]
    for name in ("gather_negatives", "activation_checkpointing", "mask_duplicates", "inference_free_queries"):
        args += ["--" + name.replace("_", "-")] if case.get(name) else []
    for name in ("cache_chunk_size", "matryoshka_dims", "lora_rank"):
        if case.get(name):
            args += ["--" + name.replace("_", "-"), case[name]]
    if case.get("packing"):
        args += ["--packing", case["packing"]]
    return args, nproc


def trained_failure(case, out):
    """Why the trained run `case` in `out` does not meet its claim, or None: its export loads in
    sentence-transformers and embeds TEXTS as the trainer's own model on the exported weights,
    built with the run's flags."""
    import conftest
    import torch

    from sentence_transformers import SentenceTransformer, SparseEncoder

    final = Path(out) / "final"
    if not final.is_dir():
        return "no final/ export"
    if case["pooling"] == "multivector":
        return multi_vector_failure(case, final)
    sparse = "SparseEncoder" in (final / "config_sentence_transformers.json").read_text()
    if sparse != (case["pooling"] == "splade"):
        return f"the export is {'a SparseEncoder' if sparse else 'a SentenceTransformer'}"
    loaded = (SparseEncoder if sparse else SentenceTransformer)(str(final), device="cpu")
    theirs = loaded.encode(TEXTS, convert_to_tensor=True)
    theirs = theirs.to_dense() if theirs.is_sparse else theirs
    cfg = config.Config(model=str(final), pooling=case["pooling"], append_eos=case["model"] == "decoder")
    ours_model = conftest.load_model(cfg)
    ours_model.model.eval()
    with torch.no_grad():
        ours = ours_model.model(**ours_model.tokenize(TEXTS)).float()
    if ours.shape != theirs.shape:
        return f"sentence-transformers' vectors are {tuple(theirs.shape)}, ours {tuple(ours.shape)}"
    if not torch.isfinite(ours).all():
        return "the trained weights give non-finite vectors"
    diff = (ours - theirs.float()).abs().max().item()
    largest = ours.abs().max().item()
    if diff > 1e-5 * max(1.0, largest):
        return f"vectors differ from sentence-transformers' by {diff:.2e} (largest {largest:.2e})"
    return None


def multi_vector_failure(case, final):
    """trained_failure of a multi-vector run: the export loads in MultiVectorEncoder, and each
    text's token vectors equal the trainer's own model's on the exported weights (its real tokens:
    no skiplist here)."""
    import conftest
    import torch

    from sentence_transformers import MultiVectorEncoder

    theirs = MultiVectorEncoder(str(final), device="cpu").encode_document(TEXTS)
    cfg = config.Config(model=str(final), append_eos=case["model"] == "decoder")
    loaded = conftest.load_model(cfg)
    loaded.model.eval()
    tokens = loaded.tokenize(TEXTS)
    with torch.no_grad():
        ours_BTD = loaded.model(**tokens).float()
    for i, their in enumerate(theirs):
        ours = ours_BTD[i][tokens["attention_mask"][i].bool()]
        if ours.shape != their.shape:
            return f"sentence-transformers' token vectors are {tuple(their.shape)}, ours {tuple(ours.shape)}"
        if not torch.isfinite(ours).all() or (ours - their.float()).abs().max().item() > 1e-5:
            return f"text {i}'s token vectors differ from sentence-transformers'"
    return None


def refusal_failure(proc, codes, words, out):
    """Why a refused run does not end as a refusal must, or None."""
    import conftest

    if any(code == 0 for code in codes):
        return f"exit codes {codes}: a rank did not fail"
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    if len(errors) != 1:
        return f"{len(errors)} error: lines: {errors[:3]}"
    if "Traceback" in text or conftest.repository_frames(text):
        return "a traceback"
    if (Path(out) / "final").exists():
        return "a final/ export was written"
    if '"world_size"' in proc.stdout:  # the run's record, printed once the weights have loaded
        return "refused after the weights loaded"
    if words and words not in errors[0]:
        return f"the error line does not name {words!r}: {errors[0]}"
    return None


def run_case(case, models, data, work, expect=None):
    """Launch `case` and judge it: (outcome, why), outcome 'trained' or 'refused' (as it should
    end) or 'FAILED'. `expect`: the words of a refusal it must end in; None: it must train."""
    import conftest

    out = Path(tempfile.mkdtemp(dir=work))
    args, nproc = launch(case, models, data, out)
    proc = conftest.warm_run(args, nproc=nproc, check=False, timeout=300)
    codes = proc.codes
    if expect is None and all(code == 0 for code in codes):
        why, outcome = trained_failure(case, out), "trained"
    else:
        why, outcome = refusal_failure(proc, codes, expect, out), "refused"
        if expect is None and why is None:
            why = "refused, and nothing says it cannot work: " + next(
                line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")
            )
        elif why and expect is None:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            why = f"{why}; last lines: {tail}"
    losses = []
    if outcome == "trained" and (out / "metrics.jsonl").exists():
        losses = [r["loss"] for r in conftest.read_metrics(out)]
    shutil.rmtree(out, ignore_errors=True)
    return ("FAILED" if why else outcome), why, losses


def short(case):
    return " ".join(f"{k}={v}" for k, v in case.items() if v not in (False, 0, "", None))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="print the runs and their number, run none")
    parser.add_argument("--fixed", action="store_true", help="the suite's fixed part instead of the matrix")
    parser.add_argument("--json", default="", help="also write every run's outcome to this file")
    args = parser.parse_args()
    if args.fixed:
        runs = [(case, None) for case in fixed_runs()]
    else:
        matrix = all_pairs(factors(), lambda case: refused(case) is None)
        runs = [(case, None) for case in matrix] + refusal_runs()
    print(f"{len(runs)} runs ({sum(e is None for _, e in runs)} must train, the rest be refused)")
    if args.list:
        for case, expect in runs:
            print(("refused " if expect else "") + short(case))
        return
    work = Path(tempfile.mkdtemp(prefix="flag-matrix-"))
    models, data = write_models(work / "models"), write_data(work)
    results, start = [], time.time()
    for i, (case, expect) in enumerate(runs):
        began = time.time()
        outcome, why, losses = run_case(case, models, data, work, expect)
        results.append({"case": case, "expect": expect, "outcome": outcome, "why": why, "losses": losses})
        print(
            f"{i + 1:3d} {outcome:8s} {time.time() - began:5.1f}s {short(case)}"
            + (f"\n    {why}" if why else ""),
            flush=True,
        )
    failed = [r for r in results if r["outcome"] == "FAILED"]
    print(
        f"{len(results)} runs in {time.time() - start:.0f} s: "
        f"{sum(r['outcome'] == 'trained' for r in results)} trained, "
        f"{sum(r['outcome'] == 'refused' for r in results)} refused as they must, {len(failed)} failed"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


def fixed_runs():
    """The suite's fixed part: each pooling mode (on its model) at each precision at one process;
    in bf16 and fp16 under FSDP2; and under DDP or FSDP1 (in turn) at one precision (in turn). MNRL
    with gathered negatives on the pairs of the matrix's runs."""
    # MNRL over every rank's candidates (--gather-negatives): the same loss at any world size, so
    # each low-precision run's losses compare with the fp32 run's at one process
    base = {**defaults(), "gather_negatives": True}
    runs = []
    for i, pooling in enumerate(values_of("pooling")):
        model = {"splade": "masked_lm", "lasttoken": "decoder"}.get(pooling, "encoder")
        settings = [("single", p) for p in values_of("precision")]
        settings += [("fsdp2:full_shard", p) for p in values_of("precision") if p != "fp32"]
        settings += [(("ddp", "fsdp1:full_shard")[i % 2], values_of("precision")[i % 3])]
        for strategy, precision in settings:
            runs.append(
                {**base, "model": model, "pooling": pooling, "strategy": strategy, "precision": precision}
            )
    return runs


if __name__ == "__main__":
    main()
