"""The export in ONNX: the whole embedding model (encoder, pooling, normalisation) as one ONNX
graph, run with onnxruntime, against sentence-transformers on the same folder.

It rebuilds the module the full trainer trains (`embedding_model.EmbeddingModel`, the pooling and
normalisation the folder declares), exports it with `torch.onnx.export` (dynamic batch and sequence
axes), runs it with onnxruntime on texts of different lengths in one padded batch, and prints the
largest difference to `SentenceTransformer(FOLDER).encode`.

Needs, beside the trainer's requirements: `pip install onnx onnxruntime onnxscript` (onnxscript
is what torch's ONNX exporter uses since torch 2.5).
Run (CPU, under a minute for all-MiniLM-L6-v2):
    python bench/bench_onnx_export.py output/example/final [--out model.onnx]
Leaves out: quantisation, graph optimisation, the Softmax head.
"""

import argparse
import os
import sys
import time

import torch

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)

from fsdp_embed import config  # noqa: E402

from fsdp_embed import embedding_model  # noqa: E402
from fsdp_embed import run_plan  # noqa: E402
from fsdp_embed import st_folder  # noqa: E402


TEXTS = [
    "A man is playing a guitar on a stage.",
    "Short.",
    "  leading and trailing spaces are stripped  ",
    "Two dogs are running through a field of tall grass while a child watches them from the fence.",
]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="a folder the full trainer exported (OUTPUT_DIR/final)")
    parser.add_argument(
        "--out", default="", help="where to write the .onnx file (default: FOLDER/onnx/model.onnx)"
    )
    args = parser.parse_args()
    import onnxruntime
    from sentence_transformers import SentenceTransformer

    out = args.out or os.path.join(args.folder, "onnx", "model.onnx")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cfg = config.Config(model=args.folder)
    # encoder + the folder's pooling and normalisation
    loaded = embedding_model.load_model(run_plan.resolve_flags(cfg, 1, torch.device("cpu")).model)
    model = loaded.model.eval()
    batch = loaded.tokenize(TEXTS)
    # In the order of EmbeddingModel.forward's arguments, which export passes positionally.
    names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in batch]
    started = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(
            model,
            tuple(batch[n] for n in names),
            out,
            input_names=names,
            output_names=["embeddings"],
            dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in names}, "embeddings": {0: "batch"}},
        )
    export_seconds = time.perf_counter() - started

    session = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
    ours = session.run(None, {n: batch[n].numpy() for n in names})[0]
    theirs = SentenceTransformer(args.folder, device="cpu").encode(TEXTS)
    st_config = st_folder.read_sentence_transformer_config(args.folder)
    size = sum(
        os.path.getsize(p) for p in (out, out + ".data") if os.path.exists(p)
    )  # weights may sit in OUT.data
    print(
        f"{out}: {size / 2**20:.1f} MiB, exported in {export_seconds:.1f} s; pooling {st_config['pooling']}, "
        f"normalize {st_config['normalize']}, {len(TEXTS)} texts of "
        f"{batch['attention_mask'].sum(1).tolist()} tokens in one batch"
    )
    print(f"max |onnxruntime - SentenceTransformer.encode| = {abs(ours - theirs).max():.2e}")


if __name__ == "__main__":
    main()
