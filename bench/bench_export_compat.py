"""Benchmark: which sentence-transformers / transformers versions load an exported model folder.

The full trainer writes a SentenceTransformer folder (OUTPUT_DIR/final/). People load such folders
with whatever versions they have installed, often older ones. For every (sentence-transformers,
transformers) pair this script installs that pair into its own virtualenv and, for each FOLDER,
measures:

  ST        SentenceTransformer(FOLDER, device="cpu") loads, embeds 4 fixed texts, and the max
            |difference| to the embeddings that this environment's own sentence-transformers
            computes (the reference); "FAIL" with the error's first line otherwise.
  AutoModel AutoModel.from_pretrained(FOLDER, output_loading_info=True): how many missing_keys
            and unexpected_keys it reports (the key names are listed under the table).
  slow tok  AutoTokenizer.from_pretrained(FOLDER, use_fast=False) loads (its class name; "ids
            differ" when its input_ids for the 4 texts differ from the fast tokenizer's), or fails:
            "no FILE" when a file that the declared tokenizer class reads is absent from FOLDER,
            else the error's first line.
  warnings  what was printed while loading (Python warnings, library logging, anything on
            stdout/stderr), shortened; the full lines are in the JSON.

Run (from the repository root; FOLDER is an exported folder such as output/final):
    python bench/bench_export_compat.py FOLDER [FOLDER ...]
    python bench/bench_export_compat.py FOLDER --pairs ST==3.4.1,transformers==4.46.3 --pairs system
    python bench/bench_export_compat.py FOLDER --venvs /tmp/compat-venvs   # where venvs are cached

It prints a Markdown table (rows: version pairs; columns: per FOLDER) followed by the key names
and errors, and writes the raw results to bench/results/export_compat.json.

Default pairs: sentence-transformers 2.2.2 + transformers 4.40.2, 2.3.1 + 4.40.2, 2.7.0 + 4.44.2,
3.4.1 + 4.46.3, 4.1.0 + 4.51.3, 5.1.2 + 4.56.2, and "system" (this Python itself, with no venv:
the installed sentence-transformers and transformers; its embeddings are the reference, so its
|diff| is 0 by construction). All of these versions install from PyPI; none is left out.

How the venvs are made: `python -m venv --system-site-packages`, so every venv reuses this
Python's torch (pip is given a constraint pinning torch to the installed version and can never
replace it). Into each venv go transformers==Y with its own dependencies (a tokenizers and a
huggingface-hub of its era shadow the newer system ones), then sentence-transformers==X with
--no-deps, because sentence-transformers 2.x requires torchvision (and would pull another torch);
its remaining needs are installed by name (see extra_requirements()):
  - every version: Pillow (sentence_transformers.models imports PIL at import time);
  - 2.x: nltk and sentencepiece; and huggingface-hub<0.26 for 2.2.x, which still imports
    huggingface_hub.cached_download (removed in huggingface-hub 0.26);
  - 3.x and later: datasets. These versions import datasets whenever it is installed, and a
    recent datasets needs a huggingface-hub newer than transformers 4.x allows (the import
    fails with "cannot import name ... from huggingface_hub.errors"), so each venv gets the
    newest datasets that pip finds compatible with its huggingface-hub.
After installing, the venv must import torch (the system one), transformers==Y and
sentence_transformers==X; a pair that installs but cannot import is reported with the error's
first line instead of being measured. A pair that cannot be installed is reported the same way.

Time (2 CPU cores, 2 folders): the first run installs 6 venvs, about 4 minutes (longer on a
cold pip cache); a re-run with cached venvs takes about 70 s (one child process per pair, each
imports torch and loads every FOLDER three times). Disk: 150-180 MB per venv. Each child has a
--timeout (default 600 s). Pip installs run one after the other; children use one thread.

What it leaves out: GPU and half-precision loading; trust_remote_code models; the fast
tokenizer's behaviour beyond comparing input_ids with the slow one; sentence-transformers
versions before 2.2 and transformers before 4.40 (their pairs can be given with --pairs, but
the install rules above are only tested for the default pairs); loading from the Hub (everything
runs with HF_HUB_OFFLINE=1 on local folders); any quality measure beyond the |diff| of 4
embeddings to the reference.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_PATH = os.path.join(REPO_DIR, "bench", "results", "export_compat.json")

TEXTS = [
    "A man is playing a guitar on the street.",
    "The Café on Main Street serves ÉCLAIRS every Tuesday!",
    "Embeddings",
    "Two dogs are running through a field of tall grass, chasing a bright red ball that rolls downhill.",
]

DEFAULT_PAIRS = [
    ("2.2.2", "4.40.2"),
    ("2.3.1", "4.40.2"),
    ("2.7.0", "4.44.2"),
    ("3.4.1", "4.46.3"),
    ("4.1.0", "4.51.3"),
    ("5.1.2", "4.56.2"),
    None,  # the system environment
]

CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONNOUSERSITE": "1",
    "PYTHONWARNINGS": "always",
}


def vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def extra_requirements(st_version, tf_version):
    """What sentence-transformers==st_version needs besides transformers and torch (it is installed
    with --no-deps)."""
    extras = ["Pillow"]
    if vtuple(st_version) < (3, 0, 0):
        extras += ["nltk", "sentencepiece"]
    else:
        extras.append(
            "datasets"
        )  # imported whenever installed; pip picks one that fits the venv's huggingface-hub
    if vtuple(st_version) < (2, 3, 0):
        extras.append("huggingface-hub<0.26")
    return extras


# ----------------------------------------------------------------------------- child side
# Runs inside a venv (or this Python for the "system" row). Keeps to the standard library plus
# what the venv has, and writes its results as JSON to the path it is given.


@contextlib.contextmanager
def capture_fds(box):
    """Everything written to fd 1 and 2 (print, warnings, logging, C code) goes into box['text']."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", errors="replace")


PROGRESS_RE = re.compile(r"\d+%\|| it/s\]|s/it\]|^Loading weights:|^Batches:")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def printed_lines(text, limit=40):
    seen, out = set(), []
    for line in re.split(r"[\r\n]+", ANSI_RE.sub("", text)):
        line = line.rstrip()
        if not line.strip() or PROGRESS_RE.search(line) or line in seen:
            continue
        seen.add(line)
        out.append(line[:400])
    return out[:limit]


def first_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def run_step(fn):
    """Runs fn() with output captured. Returns a dict: ok, error, printed, plus what fn returned."""
    import warnings

    box = {}
    res = {"ok": False, "error": None}
    with capture_fds(box), warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            res.update(fn() or {})
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - any failure is a result here
            if isinstance(exc, KeyboardInterrupt):
                raise
            res["error"] = first_line(exc)
    res["printed"] = printed_lines(box.get("text", ""))
    return res


def child_versions():
    import importlib

    out = {}
    for mod in ("torch", "transformers", "sentence_transformers", "tokenizers", "huggingface_hub", "numpy"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except BaseException as exc:  # noqa: BLE001
            out[mod] = "import failed: " + first_line(exc)
    return out


def slow_vocab_files(folder):
    """The files that the folder's declared (slow) tokenizer class reads, and which of them are absent."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        name = json.load(f).get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if name else None
    files = sorted(set((getattr(cls, "vocab_files_names", None) or {}).values()))
    return {
        "class": name,
        "expects": files,
        "absent": [f for f in files if not os.path.exists(os.path.join(folder, f))],
    }


def child_main(spec_path, out_path):
    import logging

    logging.basicConfig(level=logging.WARNING)
    with open(spec_path) as f:
        spec = json.load(f)
    texts = spec["texts"]
    result = {"python": sys.executable, "folders": {}}
    imports = run_step(lambda: {"versions": child_versions()})
    result["versions"] = imports.get("versions")
    result["import_printed"] = imports["printed"]
    try:
        import torch

        torch.set_num_threads(1)
    except BaseException:  # noqa: BLE001
        pass

    for folder in spec["folders"]:
        ref = spec["reference"].get(folder)
        fres = {}

        def st_step():
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(folder, device="cpu")
            emb = model.encode(texts, batch_size=len(texts), convert_to_numpy=True)
            emb = [[float(x) for x in row] for row in emb]
            out = {
                "modules": [type(m).__name__ for m in model],
                "shape": [len(emb), len(emb[0]) if emb else 0],
            }
            if ref is not None:
                if len(ref) != len(emb) or any(len(a) != len(b) for a, b in zip(ref, emb)):
                    out["max_abs_diff"] = None
                    out["diff_note"] = "shape differs from the reference"
                else:
                    out["max_abs_diff"] = max(abs(a - b) for ra, rb in zip(ref, emb) for a, b in zip(ra, rb))
            return out

        def automodel_step():
            from transformers import AutoModel

            model, info = AutoModel.from_pretrained(folder, output_loading_info=True)
            keys = {
                k: sorted(str(x) for x in (info.get(k) or []))
                for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
            }
            return dict(keys, model_class=type(model).__name__)

        def slow_tokenizer_step():
            from transformers import AutoTokenizer

            slow = AutoTokenizer.from_pretrained(folder, use_fast=False)
            out = {"tokenizer_class": type(slow).__name__}
            try:
                fast = AutoTokenizer.from_pretrained(folder)
                ids_slow = [slow(t)["input_ids"] for t in texts]
                ids_fast = [fast(t)["input_ids"] for t in texts]
                out["fast_class"] = type(fast).__name__
                out["ids_match_fast"] = ids_slow == ids_fast
            except BaseException as exc:  # noqa: BLE001
                out["fast_error"] = first_line(exc)
            return out

        fres["st"] = run_step(st_step)
        fres["automodel"] = run_step(automodel_step)
        fres["slow_tokenizer"] = run_step(slow_tokenizer_step)
        if not fres["slow_tokenizer"]["ok"]:
            fres["slow_tokenizer"]["vocab_files"] = run_step(lambda: slow_vocab_files(folder))
        result["folders"][folder] = fres
        with open(out_path, "w") as f:  # partial results survive a timeout
            json.dump(result, f, indent=1)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


# ----------------------------------------------------------------------------- parent side


def pair_label(pair):
    return "system" if pair is None else f"ST {pair[0]} + transformers {pair[1]}"


def parse_pair(text):
    if text.strip().lower() == "system":
        return None
    vals = {}
    for part in text.split(","):
        name, _, ver = part.partition("==")
        name = name.strip().lower().replace("_", "-")
        if name in ("st", "sentence-transformers"):
            vals["st"] = ver.strip()
        elif name == "transformers":
            vals["tf"] = ver.strip()
        else:
            raise argparse.ArgumentTypeError(f"unknown package in --pairs {text!r}")
    if set(vals) != {"st", "tf"} or not all(vals.values()):
        raise argparse.ArgumentTypeError(f"--pairs wants ST==X,transformers==Y or 'system', got {text!r}")
    return (vals["st"], vals["tf"])


def last_error_line(text):
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("ERROR"):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def ensure_venv(venvs_dir, pair, torch_version, reinstall):
    """Returns (python path or None, info dict). info['status'] is 'ready' or a one-line reason."""
    st, tf = pair
    vdir = os.path.join(venvs_dir, f"st-{st}_tf-{tf}")
    marker = os.path.join(vdir, "bench-ready.json")
    py = os.path.join(vdir, "bin", "python")
    if reinstall and os.path.isdir(vdir):
        shutil.rmtree(vdir)
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
        info["cached"] = True
        return (py if info["status"] == "ready" else None), info
    if os.path.isdir(vdir):
        shutil.rmtree(vdir)  # a half-made venv from an interrupted run
    os.makedirs(venvs_dir, exist_ok=True)
    t0 = time.time()
    info = {"venv": vdir, "cached": False, "extras": extra_requirements(st, tf)}
    log_path = os.path.join(vdir, "install.log")
    steps = [
        [sys.executable, "-m", "venv", "--system-site-packages", vdir],
        [
            py,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-c",
            os.path.join(vdir, "constraints.txt"),
            f"transformers=={tf}",
        ]
        + info["extras"],
        [
            py,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            f"sentence-transformers=={st}",
        ],
    ]
    status = "ready"
    for i, cmd in enumerate(steps):
        if i == 1:
            with open(os.path.join(vdir, "constraints.txt"), "w") as f:
                f.write(f"torch=={torch_version}\n")
        print(f"  $ {' '.join(cmd[1:] if i else cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if os.path.isdir(vdir):
            with open(log_path, "a") as f:
                f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
        if proc.returncode != 0:
            status = "install failed: " + last_error_line(proc.stderr + proc.stdout)
            break
    if status == "ready":
        check = (
            "import json, torch, transformers, sentence_transformers;"
            "print(json.dumps([torch.__version__, transformers.__version__, "
            "sentence_transformers.__version__]))"
        )
        proc = subprocess.run(
            [py, "-c", check], capture_output=True, text=True, env=dict(os.environ, **CHILD_ENV)
        )
        if proc.returncode != 0:
            status = "import fails: " + last_error_line(proc.stderr)
        else:
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            if got != [torch_version, tf, st]:
                status = (
                    f"wrong versions in venv: torch {got[0]}, transformers {got[1]}, "
                    f"sentence-transformers {got[2]}"
                )
    info.update(status=status, install_s=round(time.time() - t0, 1))
    if os.path.isdir(vdir):
        with open(marker, "w") as f:
            json.dump(info, f, indent=1)
    return (py if status == "ready" else None), info


def reference_embeddings(folders):
    """This environment's sentence-transformers embeddings of TEXTS for each folder (None where it fails)."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    ref, errors = {}, {}
    for folder in folders:
        try:
            with capture_fds({}):  # its load messages show up in the "system" row
                model = SentenceTransformer(folder, device="cpu")
                emb = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
            ref[folder] = [[float(x) for x in row] for row in emb]
        except Exception as exc:  # noqa: BLE001
            ref[folder] = None
            errors[folder] = first_line(exc)
    return ref, errors


def folder_facts(folder):
    facts = {"files": sorted(os.listdir(folder))}
    try:
        with open(os.path.join(folder, "config_sentence_transformers.json")) as f:
            facts["declared_versions"] = json.load(f).get("__version__")
    except (OSError, ValueError) as exc:
        facts["declared_versions"] = f"unreadable: {exc}"
    try:
        with open(os.path.join(folder, "modules.json")) as f:
            mods = json.load(f)
        for m in mods:
            if m.get("type", "").endswith("Pooling"):
                with open(os.path.join(folder, m["path"], "config.json")) as f:
                    facts["pooling"] = [
                        k[len("pooling_mode_") :]
                        for k, v in json.load(f).items()
                        if k.startswith("pooling_mode_") and v is True
                    ]
    except (OSError, ValueError, KeyError):
        pass
    return facts


def run_child(python, spec_path, timeout):
    out_fd, out_path = tempfile.mkstemp(suffix=".json", prefix="compat-child-")
    os.close(out_fd)
    os.remove(out_path)
    t0 = time.time()
    result = None
    try:
        proc = subprocess.run(
            [python, os.path.abspath(__file__), "--child", spec_path, out_path],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tempfile.gettempdir(),
            env=dict(os.environ, **CHILD_ENV),
        )
        error = (
            None
            if proc.returncode == 0
            else f"child exited {proc.returncode}: " + last_error_line(proc.stderr)
        )
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout} s"
    if os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
        os.remove(out_path)
    return result, error, round(time.time() - t0, 1)


# ----------------------------------------------------------------------------- table


def md(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def short(text, n):
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "…"


WARNING_KINDS = [
    (
        re.compile(r"newly initialized|not initialized from the model checkpoint|MISSING", re.I),
        "uninit weights",
    ),
    (re.compile(r"not used when initializing|UNEXPECTED|unused weights", re.I), "unused weights"),
    (re.compile(r"No sentence-transformers model found", re.I), "no ST config"),
    (
        re.compile(r"created with sentence.?transformers|newer version|version .* than", re.I),
        "version notice",
    ),
    (re.compile(r"deprecat", re.I), "deprecation"),
    (re.compile(r"clean_up_tokenization_spaces"), "clean_up_tokenization_spaces FutureWarning"),
    (re.compile(r"Creating a new one with (mean|MEAN) pooling", re.I), "mean pooling made up"),
]


def warning_summary(printed):
    kinds = []
    for line in printed:
        if line[:1].isspace():
            continue  # source lines that the warnings module echoes, table rows
        label = next((lab for rx, lab in WARNING_KINDS if rx.search(line)), None)
        if label is None:
            if not re.search(r"warn|error|not |missing|unexpected|fail|ignor", line, re.I):
                continue  # tables, indented detail lines, plain info
            label = short(re.sub(r"^.*?(Warning|WARNING)[:\]]?\s*", "", line).strip(), 40)
        if label not in kinds:
            kinds.append(label)
    return "; ".join(kinds) if kinds else "-"


def folder_cells(fres):
    st, am, tok = fres["st"], fres["automodel"], fres["slow_tokenizer"]
    if st["ok"]:
        d = st.get("max_abs_diff")
        st_cell = "ok, " + (f"{d:.1e}" if isinstance(d, float) else st.get("diff_note", "no reference"))
    else:
        st_cell = "FAIL: " + short(st["error"], 60)
    if am["ok"]:
        am_cell = f"{len(am['missing_keys'])}/{len(am['unexpected_keys'])}"
        if am.get("mismatched_keys"):
            am_cell += f" (+{len(am['mismatched_keys'])} mismatched)"
    else:
        am_cell = "FAIL: " + short(am["error"], 50)
    if tok["ok"]:
        tok_cell = "ok " + tok["tokenizer_class"]
        if tok.get("ids_match_fast") is False:
            tok_cell += ", ids differ"
    else:
        absent = (tok.get("vocab_files") or {}).get("absent")
        tok_cell = f"FAIL: no {', '.join(absent)}" if absent else "FAIL: " + short(tok["error"], 50)
    warn = [warning_summary(fres[k]["printed"]) for k in ("st", "automodel", "slow_tokenizer")]
    warn_cell = " / ".join(w for w in warn) if any(w != "-" for w in warn) else "-"
    return [st_cell, am_cell, tok_cell, short(warn_cell, 90)]


def render(report):
    folders = report["folders"]
    names = report["folder_names"]
    lines = []
    header = ["sentence-transformers", "transformers"]
    for f in folders:
        n = names[f]
        header += [
            f"{n}: ST load, max abs diff",
            f"{n}: AutoModel missing/unexpected",
            f"{n}: slow tokenizer",
            f"{n}: warnings (ST / AutoModel / tok)",
        ]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in report["rows"]:
        v = (row.get("result") or {}).get("versions") or {}
        st_v = v.get("sentence_transformers") or row["requested"][0]
        tf_v = v.get("transformers") or row["requested"][1]
        cells = [md(st_v) + (" (system)" if row["pair"] is None else ""), md(tf_v)]
        if row["status"] != "ready" or not row.get("result"):
            reason = row["status"] if row["status"] != "ready" else row.get("child_error") or "no result"
            cells += ["not measured: " + md(short(reason, 110))] + [""] * (4 * len(folders) - 1)
        else:
            for f in folders:
                fres = row["result"]["folders"].get(f)
                cells += (
                    [md(c) for c in folder_cells(fres)]
                    if fres
                    else ["not reached: " + md(row.get("child_error") or "?")] + [""] * 3
                )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Reference: embeddings of {len(TEXTS)} texts by this Python's sentence-transformers "
        f"{report['system_versions'].get('sentence_transformers')} "
        f"/ transformers {report['system_versions'].get('transformers')}, "
        f"torch {report['system_versions'].get('torch')}, CPU. "
        "AutoModel: counts of missing_keys/unexpected_keys."
    )
    lines.append("")
    lines.append("Folders:")
    for f in folders:
        facts = report["folder_facts"][f]
        dv = facts.get("declared_versions")
        lines.append(
            f"- {names[f]} = {f}: pooling {facts.get('pooling')}, declares {json.dumps(dv)}; "
            f"files: {', '.join(facts['files'])}"
            + (
                f"; reference FAILED: {report['reference_errors'][f]}"
                if f in report["reference_errors"]
                else ""
            )
        )
    # key names and errors, each distinct text once
    details = {}
    for row in report["rows"]:
        res = row.get("result") or {}
        for f, fres in (res.get("folders") or {}).items():
            am = fres["automodel"]
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
                if am.get(kind):
                    details.setdefault(f"{names[f]} AutoModel {kind}: {', '.join(am[kind])}", []).append(
                        pair_label(row["pair"])
                    )
            for step in ("st", "automodel", "slow_tokenizer"):
                if fres[step]["error"]:
                    details.setdefault(f"{names[f]} {step} error: {fres[step]['error']}", []).append(
                        pair_label(row["pair"])
                    )
            tok = fres["slow_tokenizer"]
            if tok.get("fast_error"):
                details.setdefault(f"{names[f]} fast tokenizer error: {tok['fast_error']}", []).append(
                    pair_label(row["pair"])
                )
    if details:
        lines.append("")
        lines.append("Details (which rows):")
        for text, rows in details.items():
            lines.append(f"- {short(text, 400)}  [{'; '.join(rows)}]")
    return "\n".join(lines)


def folder_names(folders):
    names = {}
    for f in folders:
        base = os.path.basename(f)
        name = os.path.basename(os.path.dirname(f)) if base == "final" else base
        while name in names.values():
            name += "'"
        names[f] = name
    return names


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="exported SentenceTransformer folders")
    p.add_argument(
        "--venvs",
        default=os.path.join(tempfile.gettempdir(), "compat-venvs"),
        help="where the per-pair venvs are made and cached",
    )
    p.add_argument(
        "--pairs",
        action="append",
        type=parse_pair,
        default=None,
        help="ST==X,transformers==Y, or 'system'; repeat for several (default: the pairs in the docstring)",
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per child run (one pair, all folders)")
    p.add_argument("--reinstall", action="store_true", help="remake the venvs of the measured pairs")
    p.add_argument("--out", default=RESULTS_PATH, help="where the raw JSON goes")
    args = p.parse_args()

    t_start = time.time()
    folders = [os.path.abspath(f) for f in args.folders]
    for f in folders:
        if not os.path.isfile(os.path.join(f, "modules.json")):
            p.error(f"{f} is not a SentenceTransformer folder (no modules.json)")
    pairs = args.pairs or DEFAULT_PAIRS

    import torch

    torch_version = torch.__version__
    print(
        "computing reference embeddings with this Python's sentence-transformers", file=sys.stderr, flush=True
    )
    reference, ref_errors = reference_embeddings(folders)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="compat-spec-", delete=False) as f:
        json.dump({"texts": TEXTS, "folders": folders, "reference": reference}, f)
        spec_path = f.name

    rows = []
    try:
        for pair in pairs:
            print(f"== {pair_label(pair)}", file=sys.stderr, flush=True)
            row = {"pair": pair, "requested": list(pair) if pair else ["system", "system"]}
            if pair is None:
                python, info = sys.executable, {"status": "ready", "venv": None}
            else:
                python, info = ensure_venv(args.venvs, pair, torch_version, args.reinstall)
                how = "cached" if info.get("cached") else f"{info['install_s']} s"
                print(f"  venv: {info['status']} ({how})", file=sys.stderr, flush=True)
            row.update(status=info["status"], venv=info.get("venv"), install=info)
            if python:
                result, error, secs = run_child(python, spec_path, args.timeout)
                row.update(result=result, child_error=error, child_s=secs)
                print(
                    f"  measured in {secs} s" + (f"; {error}" if error else ""), file=sys.stderr, flush=True
                )
            rows.append(row)
    finally:
        os.remove(spec_path)

    sys_versions = next(
        (r["result"]["versions"] for r in rows if r["pair"] is None and r.get("result")), None
    )
    if sys_versions is None:
        import sentence_transformers
        import transformers

        sys_versions = {
            "torch": torch_version,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
        }
    report = {
        "texts": TEXTS,
        "folders": folders,
        "folder_names": folder_names(folders),
        "folder_facts": {f: folder_facts(f) for f in folders},
        "system_versions": sys_versions,
        "reference_errors": ref_errors,
        "reference": reference,
        "venvs": os.path.abspath(args.venvs),
        "rows": rows,
        "total_s": round(time.time() - t_start, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(render(report))
    print(f"\n(total {report['total_s']} s; raw results: {args.out})")


if __name__ == "__main__":
    main()
