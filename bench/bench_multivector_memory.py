"""Benchmark: peak memory and time of one forward + backward of the multi-vector (ColBERT) MNRL loss,
fsdp_embed.multivector.mnrl_loss, whose MaxSim (multivector.maxsim) computes the (Q, N, T, S)
query-token x document-token similarities in checkpointed blocks of at most CHUNK_ELEMENTS numbers,
against a naive reference that materialises the whole (Q, N, T, S) einsum at once.

What is measured, on what: random token matrices as the loss sees them after the encoder (each token
vector L2-normalised, float32, leaf tensors with requires_grad), dim 128. A global batch of B texts
is B/2 queries of 32 tokens (each query's scoring mask keeps 8..32 of them) and B/2 documents padded
to 256 tokens (each keeps 16..256, one at the full 256). One process, the CPU; every case is a fresh
subprocess (`--case`), so that each one's memory is its own:
  - base MiB: the process's RSS after importing torch and building the inputs (no loss yet);
  - peak MiB: the RSS high-water mark (/proc/self/status VmHWM) during the forward + backward alone,
    the mark first reset to the current RSS (writing 5 to /proc/self/clear_refs);
  - added MiB = peak - base: what one loss + backward adds on top of its inputs;
  - seconds: the wall time of that forward + backward (after a warm-up call at 4 texts);
  - tokens MiB: the token matrices themselves, (Q*T*D + N*S*D) float32 numbers (in base); their
    gradients, as many again, are part of "added"; "rest" = added - their gradients: mnrl_loss's one
    copy of the documents' matrix (padded_cat, N*S*D numbers) and the similarities (the chunked loss:
    a 64 MiB block of them, its masked copy, and in backward its gradient; the naive: all of them).
The naive reference (einsum -> masked_fill -> max -> masked sum -> cross-entropy, what
sentence-transformers' colbert_scores does without a chunk budget) runs only where its estimate,
3 x Q*N*T*S x 4 bytes (the similarities, their masked copy, their gradient), stays under
--naive-limit-gib (16 GiB); elsewhere it is skipped with a note.
Correctness: at the smallest size, in float64, the chunked loss and its gradients against the naive
reference's (max |difference| must be below 1e-9), with the default CHUNK_ELEMENTS (all queries x
blocks of documents) and with a small chunk_elements that also splits the queries (maxsim alone).

Run (about 4 minutes on 2 quiet CPU cores; the 1024-text case is most of it, and 2048 texts would
take 4x that again, about a quarter of an hour, for which `--sizes 256,2048`):
    python bench/bench_multivector_memory.py
    python bench/bench_multivector_memory.py --sizes 256,1024,2048 --naive-limit-gib 16
Results: printed as a table; also written to --json (default bench/results/multivector_memory.json).

Results (2 CPU cores, 24 GiB, torch 2.13 CPU; `python bench/bench_multivector_memory.py`, 444 s in
all, beside other jobs: 1-minute load average 4 to 5.6, so the seconds are slower than a quiet
machine's, the memory is not affected):

    check, 256 texts, float64: chunked vs naive loss and gradients differ by at most 5.2e-18 (PASS,
    tolerance 1e-9; loss 4.937945; default chunks: loss 0, query grads 3.7e-18, document grads 0;
    40 queries x 1 document a block: loss 0, grads 5.2e-18)

    | loss | texts (Q+N) | Q x N x T x S | base MiB | peak MiB | added MiB | tokens MiB | rest MiB | seconds |
    |---|---|---|---|---|---|---|---|---|
    | chunked | 256 (128 + 128) | 128x128x32x256 | 329 | 528 | 200 | 18 | 182 | 12.36 |
    | naive | 256 (128 + 128) | 128x128x32x256 | 254 | 1292 | 1038 | 18 | 1020 | 9.50 |
    | chunked | 1024 (512 + 512) | 512x512x32x256 | 383 | 704 | 321 | 72 | 249 | 258.17 |
    | naive | 1024 (512 + 512) | 512x512x32x256 | skipped: estimate 24 GiB > 16 GiB | | | | | |

    chunked: the peak RSS grows by 229 MiB per 1,000 texts between 256 and 1024 texts; of that, the
    token matrices and their gradients (2 x (Q*T + N*S) * D floats) are 141 MiB, one more copy of the
    documents' matrix (mnrl_loss's padded_cat) 62 MiB, the rest 26 MiB (the (Q, N) scores, allocator
    slack). The similarity blocks do not grow with the batch. Time grows with Q x N: 21x for 16x the
    query-document pairs.

At 256 texts the chunked loss holds 200 MiB more than its inputs where the naive one holds 1038 MiB
(its 512 MiB similarity tensor and the masked copy, alive together; in backward their gradient and
its masked copy, as large), for 1.3x the time (each block's forward is computed twice:
checkpointing). At 2048 texts the same growth gives a chunked peak near 940 MiB, where the naive
similarities alone are 32 GiB. The seconds are one forward + backward of the loss alone on 2 cores;
per block (16M similarities) the einsum and the masked_fill take about 0.14 s each and the max
0.05 s here.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUERY_TOKENS, DOC_TOKENS, DIM = 32, 256, 128
MIB = 2**20


def shapes(texts):
    """(Q, T, N, S) of a global batch of `texts`: half queries, half documents."""
    return texts // 2, QUERY_TOKENS, texts - texts // 2, DOC_TOKENS


def naive_estimate_bytes(texts, element_bytes=4):
    """The naive reference's (Q, N, T, S) tensors: the similarities, their masked copy, the gradient."""
    q, t, n, s = shapes(texts)
    return 3 * q * n * t * s * element_bytes


def tokens_bytes(texts, element_bytes=4):
    """The token matrices themselves, (Q*T*D + N*S*D) numbers (their gradients: as many again)."""
    q, t, n, s = shapes(texts)
    return (q * t + n * s) * DIM * element_bytes


def docs_bytes(texts, element_bytes=4):
    """The documents' token matrix, N*S*D numbers (mnrl_loss copies it once: padded_cat)."""
    _, _, n, s = shapes(texts)
    return n * s * DIM * element_bytes


def memory_mib():
    """{VmRSS, VmHWM} of this process in MiB."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(line.split()[1]) / 1024
    return values


def make_inputs(texts, dtype, seed=0):
    """Normalised random token matrices (leaves with gradients) and their scoring masks."""
    import torch

    q_n, t, n_n, s = shapes(texts)
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(q_n, t, DIM, generator=generator, dtype=dtype), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(n_n, s, DIM, generator=generator, dtype=dtype), dim=-1)
    q_lengths = torch.randint(8, t + 1, (q_n,), generator=generator)
    d_lengths = torch.randint(16, s + 1, (n_n,), generator=generator)
    d_lengths[0] = s  # the batch is padded to its longest document
    q_mask = torch.arange(t)[None, :] < q_lengths[:, None]
    d_mask = torch.arange(s)[None, :] < d_lengths[:, None]
    return q.requires_grad_(), q_mask, d.requires_grad_(), d_mask


def naive_mnrl_loss(q_QTD, q_mask_QT, d_NSD, d_mask_NS, scale=1.0):
    """The reference: the whole (Q, N, T, S) similarity tensor at once, in the inputs' dtype."""
    import torch
    import torch.nn.functional as F

    sims_QNTS = torch.einsum("qtd,nsd->qnts", q_QTD, d_NSD)
    sims_QNTS = sims_QNTS.masked_fill(~d_mask_NS[None, :, None, :], torch.finfo(sims_QNTS.dtype).min)
    scores_QN = (sims_QNTS.max(-1).values * q_mask_QT[:, None, :]).sum(-1)
    return F.cross_entropy(scores_QN * scale, torch.arange(len(q_QTD)))


def chunked_mnrl_loss(q_QTD, q_mask_QT, d_NSD, d_mask_NS):
    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import multivector

    return multivector.mnrl_loss(q_QTD, q_mask_QT, [d_NSD], [d_mask_NS], scale=1.0)


def case(kind, texts):
    """One measurement in this (fresh) process: {base_mib, peak_mib, seconds, loss}."""
    import torch

    loss_fn = chunked_mnrl_loss if kind == "chunked" else naive_mnrl_loss
    warm = make_inputs(4, torch.float32, seed=1)
    loss_fn(*warm).backward()  # first-call costs (kernels, allocator) out of the timing
    del warm
    inputs = make_inputs(texts, torch.float32)
    base = memory_mib()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current RSS
    started = time.perf_counter()
    loss = loss_fn(*inputs)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = memory_mib()["VmHWM"]
    return {"base_mib": base, "peak_mib": peak, "seconds": seconds, "loss": loss.item()}


def check(texts):
    """max |chunked - naive| of the loss and of both gradients, float64 inputs, at `texts`: the
    chunked loss with the default CHUNK_ELEMENTS (mnrl_loss: all queries x blocks of documents) and
    with a small budget that splits the queries too (maxsim: 40 queries x 1 document a block),
    against the naive reference, float64 throughout."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, REPO_DIR)
    from fsdp_embed import multivector

    q_n, t, n_n, s = shapes(texts)

    def run(loss_fn):
        q, q_mask, d, d_mask = make_inputs(texts, torch.float64, seed=2)
        loss = loss_fn(q, q_mask, d, d_mask)
        loss.backward()
        return loss.detach(), q.grad, d.grad

    def small_chunks(q, q_mask, d, d_mask):
        scores = multivector.maxsim(q, q_mask, d, d_mask, chunk_elements=40 * t * s)
        return F.cross_entropy(scores, torch.arange(q_n))

    ref = run(naive_mnrl_loss)
    result = {"texts": texts, "inputs": "float64"}
    for name, loss_fn in (("default_chunks", chunked_mnrl_loss), ("small_chunks", small_chunks)):
        got = run(loss_fn)
        result[name] = {
            "loss_dtype": str(got[0].dtype),  # float32 would mean the scores were cast down
            "loss": (got[0].double() - ref[0]).abs().item(),
            "q_grad": (got[1] - ref[1]).abs().max().item(),
            "d_grad": (got[2] - ref[2]).abs().max().item(),
        }
    result["reference_loss"] = ref[0].item()
    result["reference_q_grad_max_abs"] = ref[1].abs().max().item()
    result["reference_d_grad_max_abs"] = ref[2].abs().max().item()
    return result


def in_subprocess(*args, script=__file__):
    """`script` (this one by default: its --case / --check) in a fresh interpreter with `args`: the
    JSON of its last line that starts with RESULT, or {"error": its last line of stderr}."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]}
    return json.loads(lines[-1][len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,1024", help="global batches (texts), comma-separated")
    parser.add_argument(
        "--naive-limit-gib", type=float, default=16.0, help="skip the naive reference above this"
    )
    parser.add_argument("--no-check", action="store_true", help="skip the float64 chunked-vs-naive check")
    parser.add_argument(
        "--json", default=os.path.join(REPO_DIR, "bench", "results", "multivector_memory.json")
    )
    parser.add_argument("--case", nargs=2, metavar=("KIND", "TEXTS"), help=argparse.SUPPRESS)
    parser.add_argument("--check", type=int, metavar="TEXTS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print("RESULT", json.dumps(case(args.case[0], int(args.case[1]))), flush=True)
        return
    if args.check:
        print("RESULT", json.dumps(check(args.check)), flush=True)
        return

    sizes = sorted(int(s) for s in args.sizes.split(","))
    started = time.time()
    results = {"sizes": sizes, "query_tokens": QUERY_TOKENS, "doc_tokens": DOC_TOKENS, "dim": DIM, "runs": []}
    if not args.no_check:
        results["check"] = check_result = in_subprocess("--check", str(sizes[0]))
        if "error" in check_result:
            print(f"check at {sizes[0]} texts failed: {check_result['error']}")
        else:
            diffs = {k: check_result[k] for k in ("default_chunks", "small_chunks")}
            worst = max(v for d in diffs.values() for k, v in d.items() if k != "loss_dtype")
            check_result["passed"] = passed = worst < 1e-9 and all(
                d["loss_dtype"] == "torch.float64" for d in diffs.values()
            )
            print(
                f"check, {sizes[0]} texts, float64: chunked vs naive loss and gradients differ by at most "
                f"{worst:.2g} ({'PASS' if passed else 'FAIL'}, tolerance 1e-9; "
                f"loss {check_result['reference_loss']:.6f}, "
                f"largest gradient entries {check_result['reference_q_grad_max_abs']:.2g} (queries), "
                f"{check_result['reference_d_grad_max_abs']:.2g} (documents)) {json.dumps(diffs)}",
                flush=True,
            )
    print("\n| loss | texts (Q+N) | Q x N x T x S | base MiB | peak MiB | added MiB | tokens MiB "
          "| rest MiB | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for texts in sizes:
        q, t, n, s = shapes(texts)
        for kind in ("chunked", "naive"):
            row = {"kind": kind, "texts": texts, "Q": q, "N": n, "T": t, "S": s}
            label = f"| {kind} | {texts} ({q} + {n}) | {q}x{n}x{t}x{s} "
            if kind == "naive" and naive_estimate_bytes(texts) > args.naive_limit_gib * 2**30:
                row["skipped"] = (
                    f"estimate {naive_estimate_bytes(texts) / 2**30:.0f} GiB > {args.naive_limit_gib:g} GiB"
                )
                print(label + f"| skipped: {row['skipped']} | | | | | |", flush=True)
                results["runs"].append(row)
                continue
            row.update(in_subprocess("--case", kind, str(texts)))
            if "error" in row:
                print(label + f"| failed: {row['error']} | | | | | |", flush=True)
            else:
                row["added_mib"] = row["peak_mib"] - row["base_mib"]
                row["tokens_mib"] = tokens_bytes(texts) / MIB  # in base; their gradients in added
                row["rest_mib"] = row["added_mib"] - row["tokens_mib"]
                print(
                    label + f"| {row['base_mib']:.0f} | {row['peak_mib']:.0f} | {row['added_mib']:.0f} "
                    f"| {row['tokens_mib']:.0f} | {row['rest_mib']:.0f} | {row['seconds']:.2f} |",
                    flush=True,
                )
            results["runs"].append(row)

    chunked = [r for r in results["runs"] if r["kind"] == "chunked" and "peak_mib" in r]
    if len(chunked) >= 2:
        small, large = chunked[0], chunked[-1]
        per_1000 = 1000 * (large["peak_mib"] - small["peak_mib"]) / (large["texts"] - small["texts"])
        span = large["texts"] - small["texts"]

        def per_1000_texts(size_fn):
            return 1000 * (size_fn(large["texts"]) - size_fn(small["texts"])) / MIB / span

        results["chunked_mib_per_1000_texts"] = per_1000
        results["tokens_and_grads_mib_per_1000_texts"] = tokens_grads = 2 * per_1000_texts(tokens_bytes)
        results["docs_copy_mib_per_1000_texts"] = copy = per_1000_texts(docs_bytes)
        results["rest_mib_per_1000_texts"] = rest = per_1000 - tokens_grads - copy
        print(
            f"\nchunked: the peak RSS grows by {per_1000:.0f} MiB per 1,000 texts between "
            f"{small['texts']} and "
            f"{large['texts']} texts; of that, the token matrices and their gradients (2 x (Q*T + N*S) * D "
            f"floats) are {tokens_grads:.0f} MiB, one more copy of the documents' matrix (mnrl_loss's "
            f"padded_cat) {copy:.0f} MiB, the rest {rest:.0f} MiB (the (Q, N) scores, allocator slack). The "
            f"similarity blocks (CHUNK_ELEMENTS: 64 MiB each, with their masked copy and gradient) "
            f"do not grow "
            f"with the batch. Time grows with Q x N: {large['seconds'] / small['seconds']:.0f}x for "
            f"{(large['texts'] / small['texts']) ** 2:.0f}x the query-document pairs."
        )
    naive = [r for r in results["runs"] if r["kind"] == "naive" and "peak_mib" in r]
    for r in naive:
        c = next(c for c in chunked if c["texts"] == r["texts"])
        print(
            f"{r['texts']} texts: naive adds {r['added_mib']:.0f} MiB and takes {r['seconds']:.2f} s; "
            f"chunked adds {c['added_mib']:.0f} MiB and takes {c['seconds']:.2f} s"
        )
    results["seconds"] = time.time() - started
    print(f"\n{results['seconds']:.0f} s in all")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
