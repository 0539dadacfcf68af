"""The export: a SentenceTransformer folder, written with no whole copy of the model on any rank.

  - `export_model` (all ranks participate): under FSDP every rank stages the part of the
    weights it holds (`stage_state_dict`, DCP; nothing is gathered) and rank 0 reads them back a
    file's worth at a time (`read_staged`); a rank on a host without rank 0's disk sends its
    staged file over the process group (`send_files_to_rank0`); LoRA adapters are merged into
    their layers; rank 0 alone writes;
  - `export_sentence_transformer` (one writer, no collective): a folder that
    `SentenceTransformer(path)` (sentence-transformers 2.x to 6.x; an inference-free SPLADE
    model's Router folder: 6.x) and
    `AutoModel.from_pretrained(path)` both load, its weights in files of a bounded size, its
    sentence-transformers files from `sentence_transformer_files`;
    st_folder.read_sentence_transformer_config reads back what it writes (pooling and include_prompt,
    Dense layers, normalisation, max length, casing, prompts), from such a folder or any other
    SentenceTransformer folder; the folder's README.md comes from model_card.py.

Usage (stage_state_dict: all ranks participate; the writer alone the rest):
    export.stage_state_dict(model, staging)
    if rank == 0:
        names = list(export.staged_tensors(staging))
        st_files = export.sentence_transformer_files(hf_config.hidden_size, pooling_mode="mean", ...)
        export.export_sentence_transformer(out_dir, [lambda: export.read_staged(staging, names)],
                                           hf_config, tokenizer, st_files, max_seq_length=256)

Needs torch, transformers and safetensors, and fsdp_embed/st_folder.py (the pooling keys); for
`export_model` also fsdp_utils.py, fsdp_embed/sharding.py (which FSDP), fsdp_embed/checkpoint_warnings.py,
fsdp_embed/lora.py, fsdp_embed/faults.py and fsdp_embed/model_card.py: its whole copy set.
"""

import copy
import functools
import glob
import importlib.metadata
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fsdp_utils
from fsdp_embed import checkpoint_warnings
from fsdp_embed import faults
from fsdp_embed import lora
from fsdp_embed import model_card
from fsdp_embed import sharding
from fsdp_embed import st_folder


def export_model(model, loaded, out_dir, plan, record, is_rank0):
    """(all ranks participate) Under FSDP each rank writes the part of the weights it holds beside
    the export (a collective; nothing is gathered), and rank 0 reads it back one output file's worth at a
    time: no rank ever holds the whole model. A rank on a host without rank 0's disk
    (sees_output_dir[rank] False) writes its part on its own disk and sends the file to rank 0
    over the process group. One process and DDP hold the model whole already: rank 0 reads its
    own copy. Rank 0 alone writes the SentenceTransformer folder, with its model card.
    A disk without room for it stops every rank before anything is written, and a write that
    fails stops every rank with what was half written removed (faults.DiskFull): an older export
    at `out_dir` is then untouched. `plan`: the run's (run_plan.py); `record`: what it derived
    (run_plan.record) and its summary, saved in the export with the flags and read by its card."""
    # A leftover of a killed run goes at the next start, as the other *.tmp-*.
    staging = f"{out_dir}.tmp-staged"
    sharded = sharding.is_fsdp1(model) or sharding.is_fsdp2(model)
    folder, what = os.path.dirname(os.path.abspath(out_dir)), f"the export {out_dir}"
    faults.check_space(folder, size_estimate(loaded, plan.export_dtype, sharded), what)

    def remove_half_written():  # rank 0's, after a failed write
        for path in (staging, f"{os.path.abspath(out_dir)}.tmp-{os.getpid()}"):
            shutil.rmtree(path, ignore_errors=True)

    # staging is collective; the others then wait for rank 0's writes
    # to end well.
    with faults.agreed_writes(what, folder, remove_half_written):
        if sharded:  # the same on every rank
            # each rank writes the shards it holds
            stage_state_dict(model, staging, plan.sees_output_dir)
        if is_rank0:
            write_export(loaded, out_dir, plan, record, staging if sharded else None)


def size_estimate(loaded, export_dtype, sharded):
    """About the bytes an export takes while it is written: the weights in --export-dtype, under
    FSDP the staged fp32 copy beside them, and the tokenizer (its tokenizer.json as text, twice
    for the slow files saved beside it, and the base's slow files), with 1 MB to spare."""
    dtype_bytes = fsdp_utils.PRECISIONS[export_dtype].itemsize
    weights = loaded.parameter_counts[0] * (dtype_bytes + (4 if sharded else 0))
    backend = getattr(loaded.tokenizer, "backend_tokenizer", None)
    tokenizer = 2 * len(backend.to_str()) if backend is not None else 0
    tokenizer += sum(os.path.getsize(path) for path in loaded.tokenizer_files.values())
    return weights + tokenizer + 10**6


def write_export(loaded, out_dir, plan, record, staging):
    """Rank 0: the SentenceTransformer folder, its weights read from `staging` (FSDP: what
    stage_state_dict wrote) or, when None, from the model itself (one process, DDP)."""
    if staging:
        tensors_of = functools.partial(read_staged, staging)
        shapes = staged_tensors(staging)
    else:
        state = loaded.model.state_dict()
        # Copies: safetensors refuses tensors that share storage.
        tensors_of = lambda names: {name: state[name].detach().clone() for name in names}  # noqa: E731
        shapes = {name: (t.shape, t.dtype) for name, t in state.items()}
    staged = sorted(shapes)
    dtype = fsdp_utils.PRECISIONS[plan.export_dtype]
    sparse = loaded.model.sparse  # SPLADE: a SparseEncoder folder, the masked LM's weights
    weight_files = exported_files(tensors_of, shapes, loaded.untrained_state, plan, dtype, sparse)
    head = tensors_under(tensors_of, staged, "classifier.")
    # each Dense layer's config and tensors, under Dense's own names (linear.weight, ...)
    dense = [
        (dense_config(d), tensors_under(tensors_of, staged, f"dense.{i}."))
        for i, d in enumerate(loaded.model.dense)
    ]
    st_files = (
        sparse_encoder_files(loaded, sparse)
        if sparse
        else multi_vector_files(loaded, [settings for settings, _ in dense])
        if loaded.model.multivector
        else sentence_transformer_files(
            loaded.export_config.hidden_size,
            pooling_mode=loaded.model.pooling,
            normalize=loaded.model.normalize,
            max_seq_length=loaded.max_seq_length,
            do_lower_case=loaded.lowercase,
            include_prompt=loaded.include_prompt,
            dense=[settings for settings, _ in dense],
            prompts=loaded.named_prompts,
        )
    )
    extra_tensor_files = {"softmax_head.safetensors": head} if head else {}
    if loaded.model.static is not None:  # inference-free SPLADE: a Router, the masked LM a route's module
        static_weight = tensors_of(["static.weight"])["static.weight"]
        extra_tensor_files[f"{STATIC_FOLDER}/model.safetensors"] = {"weight": static_weight}
    export_sentence_transformer(
        out_dir,
        weight_files,
        loaded.export_config,
        loaded.tokenizer,
        {**st_files, "training_config.json": {**plan.flags, **record}},
        max_seq_length=loaded.max_seq_length,
        readme=model_card.card(plan, loaded, record),
        dense_tensors=[tensors for _, tensors in dense],
        tokenizer_files=loaded.tokenizer_files,
        dtype=dtype,
        # The Softmax head is not part of a SentenceTransformer; keep it beside, not lost.
        extra_tensor_files=extra_tensor_files,
        model_folder=DOCUMENT_FOLDER if loaded.model.static is not None else "",
    )
    if plan.export_adapter:  # the adapters alone, for peft, on the base model
        write_adapter(os.path.join(out_dir, "adapter"), tensors_of, staged, plan.model)
    if staging:
        shutil.rmtree(staging, ignore_errors=True)


def write_adapter(folder, tensors_of, names, spec):
    """--export-adapter: the LoRA adapters among `names` (read through `tensors_of`) as a peft
    adapter folder for the base model of ModelSpec `spec`."""
    adapters = tensors_of([name for name in names if name.endswith((".lora_A", ".lora_B"))])
    lora.save_peft_adapter(
        folder,
        {k.removeprefix("encoder."): v for k, v in adapters.items()},
        rank=spec.lora_rank,
        alpha=spec.lora_alpha,
        dropout=spec.lora_dropout,
        base_model=model_card.public_name(spec.path),
    )


def tensors_under(tensors_of, names, prefix):
    """The tensors of `names` that start with `prefix`, read through `tensors_of`, without it."""
    return {
        n.removeprefix(prefix): t for n, t in tensors_of([n for n in names if n.startswith(prefix)]).items()
    }


def dense_config(layer):
    """A Dense module's config.json, as sentence-transformers writes it, for an
    embedding_model.DenseLayer (use_residual only when set: sentence-transformers before 5.7
    refuses keys it does not know)."""
    settings = {
        "in_features": layer.linear.in_features,
        "out_features": layer.linear.out_features,
        "bias": layer.linear.bias is not None,
        "activation_function": layer.activation_name,
    }
    return {**settings, "use_residual": True} if layer.use_residual else settings


def exported_files(tensors_of, shapes, untrained_state, plan, dtype, sparse=None):
    """The export's weight files, as functions that each read one file's tensors (at most
    --export-max-shard-size) through `tensors_of(names)`. Each exported tensor and the staged
    ones it is made of: the encoder's under plain HF names; a LoRA layer's weight from its base
    weight and adapters (merged: a plain model anyone loads); the untrained base tensors as
    they came (`untrained_state`). `sparse` (a SPLADE model's splade.SpladeHead): the masked LM's
    names, the encoder's under its base_model_prefix and the head's as the masked LM has them,
    less those tied to another tensor (save_pretrained's layout; from_pretrained ties them)."""
    prefix = f"{sparse.base_model_prefix}." if sparse else ""
    head = lambda name: sparse is not None and name.startswith("sparse.head_modules.")  # noqa: E731

    def renamed(name):  # a staged name as the export writes it (LoRA's adapters, before merging)
        return (
            name.removeprefix("sparse.head_modules.")
            if head(name)
            else prefix + name.removeprefix("encoder.")
        )

    adapted = lora.adapted_modules(renamed(name) for name in shapes if name.startswith("encoder."))
    sources, sizes = {}, {}
    for name, (shape, _) in sorted(shapes.items()):
        plain = lora.plain_name(renamed(name), adapted)
        exported = name.startswith("encoder.") or (head(name) and plain not in sparse.tied)
        if exported and not name.endswith((".lora_A", ".lora_B")):
            module = plain.rpartition(".")[0]
            staged = f"encoder.{module.removeprefix(prefix)}"
            adapters = [f"{staged}.lora_A", f"{staged}.lora_B"] if module in adapted else []
            sources[plain] = [name] + adapters
            sizes[plain] = shape.numel() * dtype.itemsize
    sizes.update({name: t.numel() * dtype.itemsize for name, t in untrained_state.items()})

    def read(names):  # one output file's tensors
        tensors = tensors_of(
            sorted({source for name in names if name in sources for source in sources[name]})
        )
        tensors = {renamed(name): t for name, t in tensors.items()}
        if plan.model.lora_rank:
            tensors = lora.merge_lora(tensors, plan.model.lora_alpha / plan.model.lora_rank)
        tensors.update({name: t for name, t in untrained_state.items() if name in names})
        return {name: tensors[name] for name in names}

    groups = shard_groups(sizes, plan.export_max_shard_bytes)
    return [functools.partial(read, names) for names in groups]


def stage_state_dict(model, folder, sees_output_dir=(True,)):
    """Write the model's state dict to `folder` as it lies on the ranks: each rank its own shards
    (FSDP), or each tensor once (DDP, one process). DCP's save is a collective
    (all ranks participate); when it returns, every rank's part is in rank 0's `folder`: a rank that does
    not see rank 0's disk (sees_output_dir[rank] False) sends its file there."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    on_rank0_disk = sees_output_dir[rank]
    # nobody writes into the folder before it exists (an all_reduce: a
    # folder that cannot be made stops every rank, faults.py).
    with faults.agreed_writes(f"the staged weights {folder}", os.path.dirname(folder)):
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # a leftover of a killed export
            os.makedirs(folder)
    if not on_rank0_disk:
        os.makedirs(folder, exist_ok=True)  # this host's own staging folder
    import torch.distributed.checkpoint as dcp  # (imported here: see the top of checkpoints.py)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with checkpoint_warnings.quiet_checkpoint_warnings():
        state = get_model_state_dict(model)  # sharded under FSDP, no gathering (all ranks participate)
        state = first_of_tied(state)  # safetensors refuses two names for one tensor
        # (all ranks participate): each rank writes its own shards
        dcp.save(
            state,
            storage_writer=dcp.HuggingFaceStorageWriter(
                folder, save_distributed=True, enable_consolidation=False
            ),
        )
    if all(sees_output_dir):
        return
    # DCP names each rank's file shard-{rank + 1}-...; rank 0's reader takes every file it finds.
    rank_files = glob.glob(os.path.join(glob.escape(folder), f"shard-{rank + 1:05d}-*.safetensors"))
    # rank 0 and the ranks on other hosts exchange the files over the
    # process group; the others return at once.
    send_files_to_rank0(folder, [] if on_rank0_disk else rank_files, [not s for s in sees_output_dir])
    dist.barrier()  # (all ranks participate): every file is sent before any host clears its copy
    if not on_rank0_disk:
        shutil.rmtree(folder, ignore_errors=True)


def send_files_to_rank0(folder, paths, senders, chunk_bytes=64 * 2**20):
    """Rank 0 receives into `folder` the files `paths` of every rank r with senders[r] (ranks on
    another host, whose disk rank 0 cannot read), over the process group, `chunk_bytes` at a
    time: no rank holds more than one chunk. Every rank calls it with the same `senders`
    (all ranks participate): rank 0 and the senders exchange messages, the others return at once.
    Each sender passes its own `paths`."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    device = device or torch.device("cpu")
    for source in [r for r, sends in enumerate(senders) if sends and r != 0]:  # the same order on all
        # below: each send of the source meets one recv of rank 0, in order
        if rank == source:
            header = json.dumps({os.path.basename(p): os.path.getsize(p) for p in paths}).encode()
            dist.send(torch.tensor([len(header)], device=device), dst=0)  # (all ranks participate)
            # (all ranks participate)
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst=0)
            for path in paths:
                with open(path, "rb") as f:
                    while chunk := f.read(chunk_bytes):
                        # (all ranks participate)
                        dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8).to(device), dst=0)
        elif rank == 0:
            length = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(length, src=source)  # (all ranks participate)
            header = torch.empty(int(length), dtype=torch.uint8, device=device)
            dist.recv(header, src=source)  # (all ranks participate)
            for name, size in json.loads(bytes(header.cpu().numpy())).items():
                with open(os.path.join(folder, name), "wb") as f:
                    for start in range(0, size, chunk_bytes):
                        chunk = torch.empty(min(chunk_bytes, size - start), dtype=torch.uint8, device=device)
                        dist.recv(chunk, src=source)  # (all ranks participate)
                        f.write(chunk.cpu().numpy().tobytes())


def first_of_tied(state):
    """`state` with each tensor under its first name alone: tied tensors (a masked LM's decoder is
    its word embeddings, BERT's decoder bias its head's bias) are one storage under two names. The
    export writes the first (exported_files leaves the others out), as save_pretrained does."""
    kept, seen = {}, set()
    for name, tensor in state.items():
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        plain = type(local) in (torch.Tensor, torch.nn.Parameter) and local.numel()  # not FSDP1's kind
        where = (
            (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
            if plain
            else id(tensor)
        )
        if where in seen:
            continue
        seen.add(where)
        kept[name] = tensor
    return kept


def staged_tensors(folder):
    """{name: (shape, dtype)} of the tensors `stage_state_dict` wrote to `folder`."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.HuggingFaceStorageReader(folder).read_metadata()
    return {name: (md.size, md.properties.dtype) for name, md in metadata.state_dict_metadata.items()}


def read_staged(folder, names):
    """The named tensors of a staged folder, whole (for the one writer: no collective)."""
    import torch.distributed.checkpoint as dcp

    shapes = staged_tensors(folder)
    tensors = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
    with checkpoint_warnings.quiet_checkpoint_warnings():
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(folder), no_dist=True)
    return tensors


SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text):
    """'5GB', '300MB', '1.5GiB' or a number of bytes -> bytes. GB is 10^9 bytes and GiB 2^30, as
    in transformers' `max_shard_size`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = (match.group(2).upper() or "B") if match else None
    if unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: write it like 5GB, 300MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def max_shard_bytes(text):
    """--export-max-shard-size in bytes (`parse_size`, above 0). Raises ValueError naming the flag."""
    try:
        max_bytes = parse_size(text)
    except ValueError:
        max_bytes = 0
    if max_bytes < 1:
        raise ValueError(f"--export-max-shard-size {text!r} is not a size: write it like 5GB, 300MB or 2GiB")
    return max_bytes


def shard_groups(sizes, max_bytes):
    """The names of `sizes` ({name: bytes}), in order, grouped into files of at most `max_bytes`
    each (a tensor larger than that gets a file of its own: tensors are never split)."""
    groups, total = [], 0
    for name, size in sizes.items():
        if not groups or (groups[-1] and total + size > max_bytes):
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


# ----------------------------------------------------------------------------------------------
# The SentenceTransformer folder format


def sentence_transformer_files(
    dim,
    *,
    pooling_mode,
    normalize,
    max_seq_length,
    do_lower_case=False,
    include_prompt=True,
    dense=(),
    prompts=None,
):
    """{path: JSON content} of the sentence-transformers files of a folder, for a transformer of
    hidden size `dim` with Dense layers after pooling (`dense`: each one's config.json):
        modules.json                      Transformer (path "") -> Pooling -> [Dense ...] -> [Normalize]
        sentence_bert_config.json         max_seq_length, do_lower_case (the tokenizer lowercases)
        1_Pooling/config.json             pooling mode and dimension: only the keys every
                                          sentence-transformers since 2.0 understands, plus
                                          `pooling_mode_lasttoken` when it is the mode (2.3+) and
                                          `include_prompt` when it is False (2.4+)
        2_Dense/config.json, ...          each Dense layer's
        config_sentence_transformers.json versions, similarity function, `prompts` ({name: prefix},
                                          for encode(texts, prompt_name=name))
    A Normalize module's folder N_Normalize/ is empty: modules.json names it."""
    if pooling_mode not in st_folder.POOLING_MODES:
        raise ValueError(f"pooling {pooling_mode!r} cannot be exported; use one of {st_folder.POOLING_MODES}")
    # sentence-transformers module list: the classic `sentence_transformers.models.*` names,
    # which 2.x loads natively and 3.x-6.x map to their current classes.
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    kinds += [(f"{i + 2}_Dense", "Dense") for i in range(len(dense))]
    kinds += [(f"{len(dense) + 2}_Normalize", "Normalize")] if normalize else []
    pooling = {"word_embedding_dimension": dim, "pooling_mode_mean_sqrt_len_tokens": False}
    for mode in ("mean", "cls", "max", *(["lasttoken"] if pooling_mode == "lasttoken" else [])):
        pooling[st_folder.POOLING_KEYS[mode]] = pooling_mode == mode
    if not include_prompt:
        pooling["include_prompt"] = False
    # The oldest sentence-transformers version that reads the folder (lasttoken pooling came in
    # 2.3.0, include_prompt in 2.4.0); a newer number would make older versions warn "update
    # your library".
    oldest = "2.4.0" if not include_prompt else "2.3.0" if pooling_mode == "lasttoken" else "2.0.0"
    versions = {
        "sentence_transformers": oldest,
        "transformers": importlib.metadata.version("transformers"),
        "pytorch": torch.__version__,
    }
    return {
        "modules.json": [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (path, kind) in enumerate(kinds)
        ],
        "1_Pooling/config.json": pooling,
        **{f"{i + 2}_Dense/config.json": settings for i, settings in enumerate(dense)},
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case},
        "config_sentence_transformers.json": {
            "__version__": versions,
            "prompts": prompts or {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }


# An inference-free SparseEncoder's Router: its routes' module folders, as Router.save names them.
STATIC_FOLDER, DOCUMENT_FOLDER = "query_0_SparseStaticEmbedding", "document_0_Transformer"


def router_files(loaded, strategy, activation):
    """{path: JSON content} of an inference-free SparseEncoder folder (sentence-transformers 6's
    layout, `Router.for_query_document`): the Router at the root, the query route's
    SparseStaticEmbedding (its model.safetensors and tokenizer: write_export), the document route's
    fill-mask Transformer (the masked LM, its tokenizer) and SpladePooling."""
    modules = "sentence_transformers.sparse_encoder.modules"
    types = {
        STATIC_FOLDER: f"{modules}.sparse_static_embedding.SparseStaticEmbedding",
        DOCUMENT_FOLDER: "sentence_transformers.base.modules.transformer.Transformer",
        "document_1_SpladePooling": f"{modules}.splade_pooling.SpladePooling",
    }
    router = "sentence_transformers.base.modules.router.Router"
    structure = {"query": [STATIC_FOLDER], "document": [DOCUMENT_FOLDER, "document_1_SpladePooling"]}
    parameters = {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}
    task = {"transformer_task": "fill-mask", "max_seq_length": loaded.max_seq_length}
    return {
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": router}],
        "router_config.json": {"types": types, "structure": structure, "parameters": parameters},
        f"{STATIC_FOLDER}/config.json": {"frozen": loaded.model.static.frozen},
        f"{DOCUMENT_FOLDER}/sentence_bert_config.json": {**task, "do_lower_case": loaded.lowercase},
        "document_1_SpladePooling/config.json": {
            "pooling_strategy": strategy,
            "activation_function": activation,
            "embedding_dimension": None,
        },
    }


def sparse_encoder_files(loaded, sparse):
    """{path: JSON content} of a SparseEncoder folder's sentence-transformers files, for the
    LoadedModel `loaded` whose SpladeHead is `sparse`, in the layout of sentence-transformers 5.0-5.3,
    which 5.0 on (6.x too) loads: an MLMTransformer (the masked LM, at the root), then SpladePooling.
        modules.json                      MLMTransformer (path "") -> SpladePooling
        sentence_bert_config.json         max_seq_length, do_lower_case
        1_SpladePooling/config.json       pooling_strategy, activation_function, word_embedding_dimension
        config_sentence_transformers.json versions, model_type SparseEncoder, dot product, prompts
    With static queries (inference-free SPLADE) the Router layout of sentence-transformers 6
    instead (`router_files`)."""
    strategy, activation, _ = sparse.settings
    kinds = [("", "MLMTransformer"), ("1_SpladePooling", "SpladePooling")]
    versions = {
        "sentence_transformers": "5.0.0" if loaded.model.static is None else "6.0.0",
        "transformers": importlib.metadata.version("transformers"),
        "pytorch": torch.__version__,
    }
    files = {
        "modules.json": [
            {
                "idx": i,
                "name": str(i),
                "path": path,
                "type": f"sentence_transformers.sparse_encoder.models.{kind}",
            }
            for i, (path, kind) in enumerate(kinds)
        ],
        "1_SpladePooling/config.json": {
            "pooling_strategy": strategy,
            "activation_function": activation,
            "word_embedding_dimension": loaded.export_config.vocab_size,
        },
        "sentence_bert_config.json": {
            "max_seq_length": loaded.max_seq_length,
            "do_lower_case": loaded.lowercase,
        },
    }
    if loaded.model.static is not None:  # inference-free: a Router (sentence-transformers 6 loads it)
        files = router_files(loaded, strategy, activation)
    return {
        **files,
        "config_sentence_transformers.json": {
            "__version__": versions,
            "model_type": "SparseEncoder",
            "prompts": loaded.named_prompts or {},
            "default_prompt_name": None,
            "similarity_fn_name": "dot",
        },
    }


def multi_vector_files(loaded, dense):
    """{path: JSON content} of a MultiVectorEncoder folder's sentence-transformers files (6.x), for
    the multi-vector LoadedModel `loaded` with its token-level Dense layers (`dense`: each one's
    config.json), the folder's settings kept (st_folder.MULTI_VECTOR_DEFAULTS' keys):
        modules.json                      Transformer (path "") -> Dense ... -> MultiVectorMask -> Normalize
        sentence_bert_config.json         the Transformer's settings: output, lengths, casing
        1_Dense/config.json, ...          each Dense layer's, on the token embeddings
        N_MultiVectorMask/config.json     skiplist_words, skiplist_tasks
        N_Normalize/config.json           on the token embeddings
        config_sentence_transformers.json versions, model_type MultiVectorEncoder, maxsim or meanmaxsim,
                                          the prompts (query and document markers)"""
    settings, base = loaded.model.multivector, "sentence_transformers.base.modules"
    kinds = [("", f"{base}.transformer.Transformer")]
    kinds += [(f"{i + 1}_Dense", f"{base}.dense.Dense") for i in range(len(dense))]
    mask_class = "sentence_transformers.multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"
    kinds += [(f"{len(dense) + 1}_MultiVectorMask", mask_class)]
    kinds += [(f"{len(dense) + 2}_Normalize", f"{base}.normalize.Normalize")]
    tokens = {"module_input_name": "token_embeddings", "module_output_name": "token_embeddings"}
    versions = {
        "sentence_transformers": "6.0.0",
        "transformers": importlib.metadata.version("transformers"),
        "pytorch": torch.__version__,
    }
    return {
        "modules.json": [
            {"idx": i, "name": str(i), "path": path, "type": kind} for i, (path, kind) in enumerate(kinds)
        ],
        "sentence_bert_config.json": {
            "transformer_task": "feature-extraction",
            "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            "module_output_name": "token_embeddings",
            "max_seq_length": loaded.max_seq_length,
            "do_lower_case": loaded.lowercase,
            "query_length": settings["query_length"],
            "document_length": settings["document_length"],
            "query_expansion": settings["query_expansion"],
        },
        **{f"{i + 1}_Dense/config.json": {**config, **tokens} for i, config in enumerate(dense)},
        f"{len(dense) + 1}_MultiVectorMask/config.json": {
            "skiplist_words": settings["skiplist_words"],
            "skiplist_tasks": settings["skiplist_tasks"],
            "keep_only_token_ids": None,
        },
        f"{len(dense) + 2}_Normalize/config.json": tokens,
        "config_sentence_transformers.json": {
            "__version__": versions,
            "model_type": "MultiVectorEncoder",
            "prompts": {"query": "", "document": "", **(loaded.named_prompts or {})},
            "default_prompt_name": None,
            "similarity_fn_name": settings["similarity"],
        },
    }


def export_sentence_transformer(
    out_dir,
    weight_files,
    encoder_config,
    tokenizer,
    st_files,
    *,
    max_seq_length,
    readme="",
    dense_tensors=(),
    tokenizer_files=None,
    extra_tensor_files=None,
    dtype=torch.float32,
    model_folder="",
):
    """Write a SentenceTransformer folder at `out_dir` (rank 0 only; no collective inside).

    `weight_files` is a list of functions, one per weights file, each returning that file's
    tensors: the transformer's weights with plain HF names (no "encoder." prefix), so the folder
    is also a plain HF model (`write_weight_files`). They are called one at a time, so only one
    file's tensors need be in memory (`[lambda: state_dict]` for a state dict already there).
    Floating-point tensors are written in `dtype`, which config.json states. Give it every tensor
    of the base checkpoint, the untrained ones too (a BERT pooler), or every `from_pretrained` of
    the folder warns of newly initialised weights. The tokenizer: `write_tokenizer`;
    `st_files` ({path: JSON content}: `sentence_transformer_files`, and training_config.json);
    each Dense layer's tensors (`dense_tensors`, in `dtype`) in its folder; README.md
    (`readme`: the model card); `extra_tensor_files` ({filename: tensors}) beside. Written beside
    `out_dir`, then renamed into place (`swap_into_place`): a crash never leaves a half-written
    export. `model_folder`: where the transformer and its tokenizer go (a Router's route module),
    the tokenizer also beside each other tensor file in a folder of its own."""
    out_dir = os.path.abspath(out_dir)
    tmp_dir = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    write_weight_files(os.path.join(tmp_dir, model_folder), weight_files, dtype)  # makes tmp_dir
    encoder_config = copy.deepcopy(encoder_config)
    encoder_config.dtype = dtype  # what from_pretrained(dtype="auto") loads it in
    encoder_config.save_pretrained(os.path.join(tmp_dir, model_folder))
    write_tokenizer(os.path.join(tmp_dir, model_folder), tokenizer, max_seq_length, tokenizer_files)
    for filename, file_tensors in (extra_tensor_files or {}).items():
        file_tensors = {name: t.detach().cpu().contiguous().clone() for name, t in file_tensors.items()}
        if os.path.dirname(filename):  # SparseStaticEmbedding's folder holds its tokenizer too
            os.makedirs(os.path.join(tmp_dir, os.path.dirname(filename)))
            write_tokenizer(
                os.path.join(tmp_dir, os.path.dirname(filename)), tokenizer, max_seq_length, tokenizer_files
            )
        save_file(file_tensors, os.path.join(tmp_dir, filename), metadata={"format": "pt"})
    for name in st_files:  # the modules' folders
        os.makedirs(os.path.join(tmp_dir, os.path.dirname(name)), exist_ok=True)
    for name, content in st_files.items():
        with open(os.path.join(tmp_dir, name), "w", encoding="utf8") as f:
            json.dump(content, f, indent=2)
    with open(os.path.join(tmp_dir, "README.md"), "w", encoding="utf8") as f:
        f.write(readme)
    dense_folders = [m["path"] for m in st_files["modules.json"] if m["type"].endswith("Dense")]
    for folder, tensors in zip(dense_folders, dense_tensors):
        write_weight_files(os.path.join(tmp_dir, folder), [lambda t=tensors: dict(t)], dtype)
    swap_into_place(tmp_dir, out_dir)


def write_weight_files(tmp_dir, weight_files, dtype):
    """The weights in plain HF layout, a file at a time (`weight_files`: a function per file,
    returning its tensors): model.safetensors, or with more than one file
    model-0000i-of-0000N.safetensors and model.safetensors.index.json. Floating-point tensors
    are written in `dtype`."""
    # safetensors refuses tensors that are not contiguous.
    os.makedirs(tmp_dir, exist_ok=True)
    weight_map, total_bytes = {}, 0
    for i, read in enumerate(weight_files):
        file = (
            "model.safetensors"
            if len(weight_files) == 1
            else f"model-{i + 1:05d}-of-{len(weight_files):05d}.safetensors"
        )
        tensors = read()
        for name, t in tensors.items():
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
            weight_map[name] = file
            total_bytes += tensors[name].nbytes
        save_file(tensors, os.path.join(tmp_dir, file), metadata={"format": "pt"})
        del tensors  # before the next file's are read
    if len(weight_files) > 1:
        with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w", encoding="utf8") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)


def write_tokenizer(tmp_dir, tokenizer, max_seq_length, tokenizer_files):
    """Save a copy of `tokenizer` with `model_max_length = max_seq_length` (the caller's keeps its
    own limit), so plain transformers truncates where training did. `tokenizer_files` ({name:
    path}) are copied beside it unless saving wrote them: the base model's slow-tokenizer files
    (vocab.txt, sentencepiece models), which older transformers versions need."""
    tokenizer = copy.deepcopy(tokenizer)  # the caller's keeps its own limit
    tokenizer.model_max_length = max_seq_length
    tokenizer.save_pretrained(tmp_dir)
    # Stated, not left to each transformers version's default (4.4x warns that its default will
    # change): it only affects decoding, which then agrees everywhere.
    tokenizer_config_path = os.path.join(tmp_dir, "tokenizer_config.json")
    with open(tokenizer_config_path, encoding="utf8") as f:
        tokenizer_config = json.load(f)
    tokenizer_config.setdefault(
        "clean_up_tokenization_spaces", bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    )
    with open(tokenizer_config_path, "w", encoding="utf8") as f:
        json.dump(tokenizer_config, f, indent=2)
    for name, source in (tokenizer_files or {}).items():
        if not os.path.exists(os.path.join(tmp_dir, name)):
            shutil.copyfile(source, os.path.join(tmp_dir, name))
    # A WordPiece or BPE tokenizer writes its own slow files (vocab.txt; vocab.json + merges.txt)
    # from its model, when neither saving nor the base folder gave them.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ in ("WordPiece", "BPE"):
        model_dir = os.path.join(tmp_dir, ".tokenizer-model")
        os.makedirs(model_dir)
        for file in backend.model.save(model_dir):
            if not os.path.exists(os.path.join(tmp_dir, os.path.basename(file))):
                os.rename(file, os.path.join(tmp_dir, os.path.basename(file)))
        shutil.rmtree(model_dir)


def swap_into_place(tmp_dir, out_dir):
    """Rename the finished folder `tmp_dir` to `out_dir`: the old export (if any) is removed only
    once the new one is complete."""
    old_dir = f"{out_dir}.old-{os.getpid()}"
    if os.path.exists(out_dir):
        os.rename(out_dir, old_dir)
    os.rename(tmp_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)
