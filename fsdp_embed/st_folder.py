"""What a SentenceTransformer folder says about how it embeds, read from its files: the
transformer's subfolder, the pooling mode and include_prompt, the Dense layers after pooling,
normalisation, max_seq_length, do_lower_case and the prompts; of a SparseEncoder folder (SPLADE),
its SpladePooling settings (`sparse_encoder_config`; with a Router's static queries: `router_config`);
of a MultiVectorEncoder folder (ColBERT), its mask, lengths and similarity (`multi_vector_config`),
as also of the two older layouts MultiVectorEncoder reads (a PyLate v3 folder: `pylate_v3_config`;
a Stanford ColBERT checkpoint: `stanford_colbert_config`); the model's tokenizer as training reads
texts (`load_tokenizer`); the base's slow-tokenizer files the export copies
(`base_tokenizer_files`); and the changes to a tokenizer that travel with it, so an export reads
texts as training did (`lowercase_inside`, `append_eos`, `register_prefix_tokens`). The student's
folder is read once at start-up (model_checks.model_config_of, for run_plan.flags_plan), and the
plan carries it to embedding_model.load_model; the export writes what
`read_sentence_transformer_config` reads back.

    settings = st_folder.read_sentence_transformer_config("path/or/hub-id")
    if settings["do_lower_case"]:
        st_folder.lowercase_inside(tokenizer)   # as sentence-transformers 6 lowercases: in the tokenizer

Needs transformers (to find a hub folder's files) and nothing from the project.
"""

import json
import os
import string

POOLING_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


POOLING_MODES = tuple(POOLING_KEYS)


def read_sentence_transformer_config(path):
    """What a SentenceTransformer folder (local or a hub id) says about how it embeds: the
    transformer's subfolder, pooling mode, include_prompt, the Dense layers after pooling (a dict
    each: folder, in_features, out_features, bias, activation, use_residual), normalisation,
    max_seq_length, do_lower_case, prompts, default_prompt_name and similarity_fn_name. A plain HF
    model (no modules.json) gives the defaults: mean pooling, no normalisation, no max length of
    its own. Raises ValueError for modules it does not know, or in another order."""
    import transformers

    def read_json(filename):
        file = transformers.utils.cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
        if file is None:
            return None
        with open(file, encoding="utf8") as f:
            return json.load(f)

    st_config = {"subfolder": "", "pooling": "mean", "include_prompt": True, "dense": [], "normalize": False}
    st_config |= {"max_seq_length": None, "do_lower_case": False, "prompts": {}, "default_prompt_name": None}
    # splade: SpladePooling's settings; multivector: a MultiVectorEncoder's (multi_vector_config);
    # prefix_tokens: a legacy ColBERT's [Q]/[D] markers (register_prefix_tokens)
    st_config |= {"similarity_fn_name": "cosine", "splade": {}, "multivector": None, "prefix_tokens": {}}
    modules = read_json("modules.json")
    if modules is None:
        if "HF_ColBERT" in ((read_json("config.json") or {}).get("architectures") or []):
            return stanford_colbert_config(path, read_json, st_config)
        return st_config
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    if kinds in DOCUMENT_ROUTES:
        return sparse_encoder_config(modules, read_json, st_config)
    if kinds == ["Router"]:  # inference-free SPLADE
        return router_config(path, modules, read_json, st_config)
    saved = read_json("config_sentence_transformers.json") or {}
    if saved.get("model_type") == "ColBERT" or "MultiVectorMask" in kinds:
        return multi_vector_config(path, modules, kinds, read_json, st_config)
    expected = (
        ["Transformer", "Pooling"] + ["Dense"] * kinds.count("Dense") + ["Normalize"] * ("Normalize" in kinds)
    )
    if kinds != expected:
        raise ValueError(
            f"{path}: modules {' -> '.join(kinds)} are not supported; "
            "only Transformer -> Pooling -> [Dense ...] -> [Normalize] are"
        )
    for module, kind in zip(modules, kinds):
        if kind == "Transformer":
            st_config["subfolder"] = module["path"]
            bert_config = read_json(os.path.join(module["path"], "sentence_bert_config.json")) or {}
            st_config["max_seq_length"] = bert_config.get("max_seq_length")
            st_config["do_lower_case"] = bool(bert_config.get("do_lower_case", False))
        elif kind == "Pooling":
            pooling = read_json(pooling_file := os.path.join(module["path"], "config.json"))
            st_config["pooling"] = pooling_mode_of(path, pooling_file, pooling)
            st_config["include_prompt"] = pooling.get("include_prompt", True) is not False
        elif kind == "Dense":
            st_config["dense"].append(dense_config_of(path, module["path"], read_json))
        else:
            st_config["normalize"] = True
    for key in ("prompts", "default_prompt_name", "similarity_fn_name"):
        if saved.get(key) is not None:
            st_config[key] = saved[key]
    return st_config


def sparse_encoder_config(modules, read_json, st_config):
    """read_sentence_transformer_config of a SparseEncoder folder: a masked-LM Transformer (6.x: its
    transformer_task "fill-mask"; 5.0-5.3: an MLMTransformer), then SpladePooling, whose
    pooling_strategy and activation_function are `st_config["splade"]`'s; pooling "splade"."""
    bert_config = read_json(os.path.join(modules[0]["path"], "sentence_bert_config.json")) or {}
    pooling = read_json(os.path.join(modules[1]["path"], "config.json")) or {}
    saved = read_json("config_sentence_transformers.json") or {}
    return {
        **st_config,
        "subfolder": modules[0]["path"],
        "pooling": "splade",
        "splade": {
            key: pooling.get(key, d)
            for key, d in (("pooling_strategy", "max"), ("activation_function", "relu"))
        },
        "max_seq_length": bert_config.get("max_seq_length"),  # 6.x keeps it in the tokenizer's config
        "do_lower_case": bool(bert_config.get("do_lower_case", False)),
        "prompts": saved.get("prompts") or {},
        "similarity_fn_name": "dot",
    }


# The routes of an inference-free SparseEncoder's Router this trainer reads (by class name;
# sentence-transformers 5.x called the fill-mask Transformer MLMTransformer).
QUERY_ROUTE = ["SparseStaticEmbedding"]
DOCUMENT_ROUTES = (["Transformer", "SpladePooling"], ["MLMTransformer", "SpladePooling"])


def router_config(path, modules, read_json, st_config):
    """read_sentence_transformer_config of an inference-free SparseEncoder folder: one Router whose
    "query" route is a SparseStaticEmbedding and whose "document" route is the fill-mask
    Transformer (5.x: MLMTransformer) and SpladePooling. The document route's settings are
    `sparse_encoder_config`'s; `st_config["static_queries"]`: the query module's folder and frozen.
    Raises ValueError for any other routes, or route mappings (by task and modality)."""
    router = read_json(os.path.join(modules[0]["path"], "router_config.json")) or {}
    types, structure = router.get("types", {}), router.get("structure", {})
    kinds = {route: [types.get(i, "").rsplit(".", 1)[-1] for i in ids] for route, ids in structure.items()}
    mappings = (router.get("parameters") or {}).get("route_mappings")
    if set(kinds) != {"query", "document"} or kinds["query"] != QUERY_ROUTE or mappings:
        raise ValueError(
            f"{path}: a Router with routes {kinds} (route mappings: {mappings or 'none'}) is not supported; "
            "only query: SparseStaticEmbedding and document: Transformer (fill-mask) -> SpladePooling are"
        )
    if kinds["document"] not in DOCUMENT_ROUTES:
        raise ValueError(
            f"{path}: the Router's document route {kinds['document']} is not supported; "
            "only Transformer (fill-mask) -> SpladePooling is"
        )
    query_folder = os.path.join(modules[0]["path"], structure["query"][0])
    static = read_json(os.path.join(query_folder, "config.json")) or {}
    if "path" in static:  # SparseStaticEmbedding.load reads an IDF JSON named there instead
        raise ValueError(
            f"{path}: {query_folder} takes its weights from {static['path']}; save the "
            "model with SparseEncoder.save first, which writes them as model.safetensors"
        )
    documents = [{"path": os.path.join(modules[0]["path"], i)} for i in structure["document"]]
    settings = sparse_encoder_config(documents, read_json, st_config)
    return {**settings, "static_queries": {"folder": query_folder, "frozen": bool(static.get("frozen"))}}


MULTI_VECTOR_MODULES = ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
# What MultiVectorEncoder(a plain or dense folder) builds: a new Dense projection to 128 numbers a
# token, without bias, where the folder has no Dense layer, and this mask and similarity.
MULTI_VECTOR_DIM = 128
MULTI_VECTOR_DEFAULTS = {
    "skiplist_words": [],
    "skiplist_tasks": ["document"],
    "query_length": None,
    "document_length": None,
    "query_expansion": None,
    "similarity": "maxsim",
}


def multi_vector_config(path, modules, kinds, read_json, st_config):
    """read_sentence_transformer_config of a MultiVectorEncoder folder (sentence-transformers 6):
    Transformer -> Dense (token level) -> MultiVectorMask -> Normalize (token level), pooling
    "multivector". `st_config["multivector"]`: the mask's skiplist_words and skiplist_tasks, the
    Transformer's query_length, document_length and query expansion (strategy, attend, token,
    length), the similarity (maxsim or meanmaxsim); the Dense layer is `st_config["dense"]`'s one.
    A PyLate v3 folder (model_type ColBERT) is read by `pylate_v3_config`.
    Raises ValueError for every setting this trainer does not train as sentence-transformers
    computes it, naming it: an allowlist of token ids, token pooling, other modules, an expansion
    it does not understand."""
    saved = read_json("config_sentence_transformers.json") or {}
    if saved.get("model_type") == "ColBERT":
        return pylate_v3_config(path, modules, kinds, read_json, st_config)
    if kinds != MULTI_VECTOR_MODULES:
        raise ValueError(
            f"{path}: multi-vector modules {' -> '.join(kinds)} are not supported; "
            f"only {' -> '.join(MULTI_VECTOR_MODULES)} is"
        )
    bert_config = read_json(os.path.join(modules[0]["path"], "sentence_bert_config.json")) or {}
    mask = read_json(os.path.join(modules[2]["path"], "config.json")) or {}
    if mask.get("keep_only_token_ids") is not None:
        raise ValueError(f"{path}: MultiVectorMask's keep_only_token_ids (image patches) is not supported")
    similarity = saved.get("similarity_fn_name") or "maxsim"
    if similarity not in ("maxsim", "meanmaxsim"):
        raise ValueError(f"{path}: similarity {similarity!r} is not supported; maxsim or meanmaxsim is")
    tasks = mask.get("skiplist_tasks", ["document"])
    settings = {
        "skiplist_words": list(mask.get("skiplist_words") or []),
        "skiplist_tasks": [tasks] if isinstance(tasks, str) else list(tasks),
        **{key: bert_config.get(key) for key in TRANSFORMER_KEYS},
        "similarity": similarity,
    }
    dense = dense_config_of(path, modules[1]["path"], read_json, level="token_embeddings")
    return multi_vector_st_config(path, st_config, modules[0]["path"], bert_config, dense, settings, saved)


# The multi-vector settings a MultiVectorEncoder's Transformer module takes (sentence_bert_config.json).
TRANSFORMER_KEYS = ("query_length", "document_length", "query_expansion")


def multi_vector_st_config(path, st_config, subfolder, bert_config, dense, settings, saved):
    """The read_sentence_transformer_config of a multi-vector folder of any layout, from its
    Transformer's folder and settings (`bert_config`), its token-level Dense layer's settings, the
    MultiVectorEncoder settings (`settings`: MULTI_VECTOR_DEFAULTS' keys) and its saved prompts.
    Raises ValueError for a query expansion this trainer does not understand."""
    expansion = settings["query_expansion"]
    if expansion is not None and (
        set(expansion) - {"strategy", "attend", "token", "length"}
        or expansion.get("strategy") not in ("fixed", "min")
        or not isinstance(expansion.get("length"), int)
        or expansion["length"] < 1
    ):
        raise ValueError(
            f"{path}: query expansion {expansion} is not understood; strategy fixed or min, a length of "
            "at least 1 token, and optionally attend and token are"
        )
    if expansion is not None:
        settings["query_expansion"] = {"attend": False, "token": None, **expansion}
    return {
        **st_config,
        "subfolder": subfolder,
        "pooling": "multivector",
        "dense": [dense],
        "normalize": True,
        "max_seq_length": bert_config.get("max_seq_length"),
        "do_lower_case": bool(bert_config.get("do_lower_case", False)),
        "prompts": saved.get("prompts") or {},
        "similarity_fn_name": settings["similarity"],
        "multivector": settings,
    }


def pylate_v3_config(path, modules, kinds, read_json, st_config):
    """read_sentence_transformer_config of a PyLate v3 folder (config_sentence_transformers.json's
    model_type "ColBERT"; modules Transformer -> pylate Dense), read as MultiVectorEncoder reads it
    (_parse_model_config, _get_module_init_defaults, _apply_legacy_fixups): the Dense layer on the
    tokens, then a MultiVectorMask (the saved skiplist_words, else string.punctuation, as PyLate
    masked by default; on the documents) and a token-level Normalize; query_prefix and
    document_prefix become the "query" and "document" prompts (prepended to the saved prompt) and
    prefix tokens (register_prefix_tokens); the flat expansion fields become query_expansion
    (`legacy_transformer_settings`); a similarity other than maxsim or meanmaxsim (PyLate's
    "MaxSim") falls back to maxsim. Raises ValueError for other modules."""
    if kinds != ["Transformer", "Dense"]:
        raise ValueError(
            f"{path}: PyLate v3 modules {' -> '.join(kinds)} are not supported; only Transformer -> Dense is"
        )
    saved = read_json("config_sentence_transformers.json") or {}
    prompts, prefixes = dict(saved.get("prompts") or {}), {}
    for key, task in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in saved:  # PyLate inserted the prefix ahead of the prompt's text
            prefixes[task] = saved[key] or ""
            prompts[task] = prefixes[task] + (prompts.get(task) or "").removeprefix(prefixes[task])
    bert_config = read_json(os.path.join(modules[0]["path"], "sentence_bert_config.json")) or {}
    # The folder's own Transformer settings win over the translated ones (setdefault priority).
    transformer = {**legacy_transformer_settings(saved), **bert_config}
    skiplist = saved.get("skiplist_words")
    similarity = saved.get("similarity_fn_name")
    settings = {
        "skiplist_words": list(string.punctuation) if skiplist is None else list(skiplist),
        "skiplist_tasks": ["document"],
        **{key: transformer.get(key) for key in TRANSFORMER_KEYS},
        "similarity": similarity if similarity in ("maxsim", "meanmaxsim") else "maxsim",
    }
    dense = dense_config_of(path, modules[1]["path"], read_json, level="token_embeddings")
    st_config = {**st_config, "prefix_tokens": prefixes}
    saved = {**saved, "prompts": prompts}
    return multi_vector_st_config(path, st_config, modules[0]["path"], bert_config, dense, settings, saved)


# The saved fields that mark a PyLate (or Stanford) configuration (MultiVectorEncoder._parse_model_config).
PYLATE_MARKERS = TRANSFORMER_KEYS + (
    "do_query_expansion",
    "attend_to_expansion_tokens",
    "attend_to_mask_tokens",
    "query_prefix",
    "document_prefix",
    "skiplist_words",
)


def legacy_transformer_settings(saved):
    """The Transformer settings MultiVectorEncoder._parse_model_config reads from a PyLate save's
    config_sentence_transformers.json (`saved`): its query_length, document_length (None: left out)
    and query_expansion; a save without query_expansion expands queries (fixed, to query_length,
    else 32, its [MASK]s attended to per attend_to_expansion_tokens) unless do_query_expansion is
    false; query_length then moves into the expansion, and no longer cuts queries itself."""
    knobs = {
        key: saved[key]
        for key in TRANSFORMER_KEYS
        if key in saved and (saved[key] is not None or key == "query_expansion")
    }
    if "query_expansion" not in knobs and any(key in saved for key in PYLATE_MARKERS):
        if saved.get("do_query_expansion") is False:
            knobs["query_expansion"] = None
        else:
            attend = saved.get("attend_to_expansion_tokens", saved.get("attend_to_mask_tokens"))
            length = knobs.pop("query_length", None) or saved.get("query_length") or 32
            knobs["query_expansion"] = {"strategy": "fixed", "attend": bool(attend), "length": length}
    return knobs


def stanford_colbert_config(path, read_json, st_config):
    """read_sentence_transformer_config of a Stanford-NLP ColBERT checkpoint (config.json's
    architectures ["HF_ColBERT"], no modules.json), read as MultiVectorEncoder builds it
    (_load_default_modules, _maybe_load_stanford_metadata, _build_stanford_projection): the
    transformer at the root; a token-level Dense without bias from the `linear.weight` beside the
    encoder's weights; from artifact.metadata (defaults where it is missing) the query and document
    markers as prompts and prefix tokens ("[unused0] ", "[unused1] "), doc_maxlen as the document
    length, queries always [MASK]-expanded (fixed, to query_maxlen, else 32, attended to per
    attend_to_mask_tokens), and a skiplist of string.punctuation on the documents unless
    mask_punctuation is false; maxsim. Raises ValueError when the projection cannot be found."""
    metadata = read_json("artifact.metadata") or {}
    prefixes = {
        "query": (metadata.get("query_token_id") or "[unused0]") + " ",
        "document": (metadata.get("doc_token_id") or "[unused1]") + " ",
    }
    out_features, in_features = root_projection_shape(path)
    dense = {"folder": "", "in_features": in_features, "out_features": out_features, "bias": False}
    dense.update(activation="torch.nn.modules.linear.Identity", use_residual=False)
    expansion = {
        "strategy": "fixed",
        "attend": bool(metadata.get("attend_to_mask_tokens")),
        "length": metadata.get("query_maxlen") or 32,
    }
    settings = {
        **MULTI_VECTOR_DEFAULTS,
        "skiplist_words": list(string.punctuation) if metadata.get("mask_punctuation", True) else [],
        "document_length": metadata.get("doc_maxlen"),
        "query_expansion": expansion,
    }
    st_config = {**st_config, "prefix_tokens": prefixes}
    saved = {"prompts": dict(prefixes)}
    return multi_vector_st_config(path, st_config, "", {}, dense, settings, saved)


def root_projection_shape(path):
    """(out_features, in_features) of the `linear.weight` a Stanford ColBERT checkpoint keeps beside
    its encoder's weights, in model.safetensors or pytorch_model.bin (sentence-transformers' Dense
    .load_torch_weights reads these two). Raises ValueError when neither holds it."""
    import torch
    import transformers
    from safetensors import safe_open

    for name in ("model.safetensors", "pytorch_model.bin"):
        file = transformers.utils.cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        if file is None:
            continue
        if name.endswith(".safetensors"):
            with safe_open(file, "pt") as f:
                if "linear.weight" in f.keys():
                    return tuple(f.get_slice("linear.weight").get_shape())
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            if "linear.weight" in state:
                return tuple(state["linear.weight"].shape)
        break
    raise ValueError(
        f"{path}: a Stanford ColBERT (HF_ColBERT) checkpoint without its projection linear.weight in "
        "model.safetensors or pytorch_model.bin (sharded weights are not read here)"
    )


def register_prefix_tokens(tokenizer, prefixes):
    """Make the tokenizer read a legacy ColBERT's prefix markers (`prefixes`: {task: "[Q] " or
    "[unused0] "}) as one special token each, as MultiVectorEncoder._register_prefix_tokens does:
    a prefix (the whole value, else its first word) the tokenizer knows (an added token or in its
    vocabulary) but splits (BERT reads [unused0] as [, unused, ##0, ]; a lowercasing tokenizer
    misses an added "[Q] ") becomes a special, unnormalised token, so prepending it as text gives the
    ids the model was trained on. Prefixes it does not know stay plain text: no new embeddings."""
    from transformers import AddedToken

    added = set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    vocab = tokenizer.get_vocab()
    to_register = []
    for value in prefixes.values():
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix not in added and prefix not in vocab:
                continue
            if tokenizer.tokenize(prefix) != [prefix]:
                to_register.append(AddedToken(prefix, normalized=False, special=True))
            break
    if to_register:
        tokenizer.add_special_tokens({"additional_special_tokens": to_register})


def dense_config_of(path, folder, read_json, level="sentence_embedding"):
    """A Dense module's settings, from `folder`/config.json of the SentenceTransformer folder
    `path`, as sentence-transformers writes them: in_features, out_features, bias, the activation's
    class (a torch.nn module, built with no arguments) and use_residual. Raises ValueError for
    what this project cannot train as sentence-transformers computes it."""
    dense = read_json(os.path.join(folder, "config.json"))
    if dense is None:
        raise ValueError(f"{path}: modules.json lists a Dense module, but {folder}/config.json is missing")
    activation = dense.get("activation_function", "torch.nn.modules.activation.Tanh")
    if not activation.startswith("torch.nn."):
        raise ValueError(
            f"{path}: the Dense module in {folder} uses the activation {activation}; "
            "only torch.nn modules are supported (no remote code)"
        )
    for key in ("module_input_name", "module_output_name"):  # `level`: on the sentence or each token
        if dense.get(key, level) not in (None, level):
            raise ValueError(
                f"{path}: the Dense module in {folder} reads or writes {dense[key]!r}; "
                f"only Dense layers on the {level} are supported here"
            )
    return {
        "folder": folder,
        "in_features": int(dense["in_features"]),
        "out_features": int(dense["out_features"]),
        "bias": bool(dense.get("bias", True)),
        "activation": activation,
        "use_residual": bool(dense.get("use_residual", False)),
    }


def pooling_mode_of(path, pooling_file, pooling):
    """The pooling mode that a Pooling module's config.json (`pooling_file` in the folder `path`,
    its content `pooling`, None when it is missing) enables. Raises ValueError when it is missing
    or enables anything but exactly one of POOLING_MODES."""
    if pooling is None:
        raise ValueError(
            f"{path}: modules.json lists a Pooling module, but {pooling_file} is missing; "
            "restore it from the original folder"
        )
    named = pooling.get("pooling_mode")  # sentence-transformers 6 names the mode (or a list of them)
    if isinstance(named, (str, list)):
        enabled = [named] if isinstance(named, str) else named
        modes = [mode for mode in POOLING_MODES if [mode] == enabled]
    else:  # earlier versions: one flag per mode
        enabled = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
        modes = [mode for mode, key in POOLING_KEYS.items() if [key] == enabled]
    if not modes:
        raise ValueError(
            f"{path}: pooling {enabled} is not supported; "
            f"one of {POOLING_MODES} is (or override with --pooling)"
        )
    return modes[0]


def load_tokenizer(path, subfolder, remote, eos, st_config):
    """The model's tokenizer as training reads texts: an EOS token appended to each (`eos`:
    --append-eos), everything lowercased inside the tokenizer where the folder (`st_config`:
    read_sentence_transformer_config's) says do_lower_case, a legacy ColBERT's prefix markers read
    as one token each (register_prefix_tokens)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path, subfolder=subfolder, **remote)
    if eos:
        append_eos(tokenizer)
    if st_config["do_lower_case"]:
        lowercase_inside(tokenizer)
    # After lowercasing, as MultiVectorEncoder registers them once its Transformer is built.
    register_prefix_tokens(tokenizer, st_config.get("prefix_tokens") or {})
    return tokenizer


def lowercase_inside(tokenizer):
    """Make the tokenizer lowercase every text itself, as sentence-transformers 6 does for a folder
    with do_lower_case (its Transformer module: a Lowercase normaliser before the tokenizer's own,
    unless that is, or holds, a Lowercase), so prompts and texts are lowercased alike, spaces kept
    (Python's str.lower differs on a few letters: a final sigma). A slow tokenizer gets its
    do_lower_case."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        tokenizer.do_lower_case = True
        return
    from tokenizers import normalizers

    normalizer = backend.normalizer
    steps = list(normalizer) if isinstance(normalizer, normalizers.Sequence) else [normalizer]
    steps = [step for step in steps if step is not None]
    if not any(isinstance(step, normalizers.Lowercase) for step in steps):
        backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *steps])


# What slow tokenizers (and transformers before 4.57) read, where the model family has them.
SLOW_TOKENIZER_FILES = (
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "spiece.model",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
)


def base_tokenizer_files(path, subfolder):
    """{name: local path} of the base model's slow-tokenizer files, which the export copies."""
    import transformers

    found = {}
    for name in SLOW_TOKENIZER_FILES:
        try:
            file = transformers.utils.cached_file(
                path, name, subfolder=subfolder, _raise_exceptions_for_missing_entries=False
            )
        except OSError:  # an unreachable hub: the fast tokenizer.json is still exported
            file = None
        if file:
            found[name] = file
    return found


def append_eos(tokenizer):
    """Make the tokenizer itself end every text with its EOS token: a post-processor, which runs
    after truncation (truncation leaves it room, so it is never cut off) and is saved in
    tokenizer.json, so the export appends it wherever it is loaded. A tokenizer class with its
    own switch (Llama's add_eos_token, saved in tokenizer_config.json) uses that instead: it
    rebuilds its post-processor from it when loaded. check_model (model_checks.py) has checked that
    there is an EOS token and a fast tokenizer."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if tokenizer("a")["input_ids"][-1] == eos_id:
        return  # it appends one already
    if hasattr(tokenizer, "add_eos_token"):
        tokenizer.add_eos_token = True
    else:
        from tokenizers import processors

        backend = tokenizer.backend_tokenizer
        template = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)]
        )
        backend.post_processor = (
            template
            if backend.post_processor is None
            else processors.Sequence([backend.post_processor, template])
        )
    if tokenizer("a")["input_ids"][-1] != eos_id:
        raise ValueError(
            f"--append-eos: the {type(tokenizer).__name__} did not take the EOS post-processor; "
            "drop --append-eos"
        )
