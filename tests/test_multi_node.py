"""Two real hosts (tests/two_hosts.py: network + UTS namespaces with their own hostnames, joined by
a veth cable; one torchrun per host, c10d rendezvous at hosta, gloo on each host's cable):

- without a shared disk (each host its own --output-dir), DDP and FSDP2 (2 processes a host,
  below; FSDP1 stages and sends its shards through the same export code) export the same model
  as one host with the same global batch, and nothing is left on hostb (on a shared disk: the
  healing test below);
- --save-steps without a shared disk is refused at start-up with one error line, nothing written,
  and so is another copy of the training data on one host;
- hybrid_shard (and full_shard) on 2 hosts x 2 processes, without a shared disk, trains and
  exports as one host with the same rows in every micro-batch (world 2, 2 accumulation steps;
  test_equivalence.py shows that equals world 4), and hybrid sends at most half of full_shard's
  bytes over the cable (counted on the veth);
- the cable pulled out mid-run: every process on both hosts exits non-zero within
  --dist-timeout-minutes plus a margin, each host printing an error line, and every checkpoint
  that looks complete is;
- a worker killed on hostb under --max-restarts heals across hosts to the weights of an unbroken run;
- an elastic launch (--nnodes 1:2, --max-restarts, --resume auto) whose hostb is cut off mid-run
  goes on with hosta alone: its processes restart, meet at world 1, resume the newest checkpoint
  with twice the accumulation (the global batch kept: run_plan.resumed_batches), and end on the
  unbroken two-process run's weights, metrics.jsonl holding each step once with its world size.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).

Run: python -m pytest tests/test_multi_node.py   (as root)
"""

import json
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import REPO_DIR, assert_same_training, data_file, export_weights, program, warm_run

from fsdp_embed import checkpoints
import two_hosts

pytestmark = pytest.mark.skipif(two_hosts.why_not() is not None, reason=str(two_hosts.why_not()))

NUM_STEPS = 5
TRAIN = program()  # the full trainer: -m fsdp_embed


def common_args(model, grad_accum_steps=2, steps=NUM_STEPS):
    """A global batch of 8 at world 2 (2 rows x 2 accumulation steps), or at world 4 with
    grad_accum_steps 1: the same rows in every micro-batch either way (batches.py)."""
    return [
        *("--model", model, "--loss", "mnrl", "--train-data", data_file("sick-triplets-train.jsonl")),
        *("--max-steps", steps, "--per-device-batch-size", 2, "--grad-accum-steps", grad_accum_steps),
        *("--lr", 1e-4, "--dropout", 0, "--max-seq-length", 48, "--log-steps", 1, "--seed", 3),
        *("--max-grad-norm", 0.1),
    ]


def run_two_hosts(hosts, args_a, args_b, nproc=1, timeout=300, **kwargs):
    """One torchrun per host; returns (returncodes, [(stdout, stderr)], seconds)."""
    procs = hosts.torchrun([[*TRAIN, *args_a], [*TRAIN, *args_b]], nproc=nproc, **kwargs)
    return hosts.wait(procs, timeout)


def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())


def largest_difference(run_dir, reference_dir):
    weights, reference = export_weights(run_dir / "final"), export_weights(reference_dir / "final")
    return max((weights[k] - reference[k]).abs().max().item() for k in reference)


@pytest.fixture(scope="module")
def one_host_world_2(tmp_path_factory, tiny_model):
    """The reference: one host, two processes, the same global batch (and the same rows in each
    micro-batch as at world 4 without accumulation)."""
    out = tmp_path_factory.mktemp("one-host")
    warm_run([*common_args(tiny_model), "--output-dir", out], nproc=2)
    return out


def assert_exported_as_one_host(out_a, out_b, outputs, reference, name):
    """hosta's export trained as one host; progress, metrics and the summary come from global
    rank 0 (hosta) alone; hostb is left with nothing (its staged shards went to rank 0)."""
    assert_same_training(out_a, reference, NUM_STEPS)
    print(name, "largest weight difference to one host", largest_difference(out_a, reference))
    (out_a_text, err_a), (out_b_text, err_b) = outputs
    assert "train: 100%" in err_a and "exported" in out_a_text, (out_a_text, err_a[-2000:])
    assert "train:" not in err_b and "exported" not in out_b_text and '"final_loss"' not in out_b_text
    assert files_under(out_b) == []
    from sentence_transformers import SentenceTransformer

    loaded = SentenceTransformer(str(out_a / "final"), device="cpu")  # was "size mismatch" on half tensors
    assert loaded.encode(["a host each"]).shape == (1, 64)


def test_two_hosts_without_a_shared_disk_export_what_one_host_does(tmp_path, tiny_model, one_host_world_2):
    """DDP, a process a host (FSDP2 at 2 processes a host: the hybrid_shard test below)."""
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    args = [*common_args(tiny_model), "--dist-timeout-minutes", 2]
    with two_hosts.TwoHosts() as hosts:
        codes, outputs, _ = run_two_hosts(
            hosts, [*args, "--output-dir", out_a], [*args, "--output-dir", out_b]
        )
    assert codes == [0, 0], outputs
    assert_exported_as_one_host(out_a, out_b, outputs, one_host_world_2, "ddp")


def test_save_steps_without_a_shared_disk_is_refused(tmp_path, tiny_model):
    args = [*common_args(tiny_model), "--strategy", "fsdp", "--fsdp-version", "2", "--save-steps", 2]
    with two_hosts.TwoHosts() as hosts:
        codes, outputs, _ = run_two_hosts(
            hosts, [*args, "--output-dir", tmp_path / "a"], [*args, "--output-dir", tmp_path / "b"]
        )
    assert all(code != 0 for code in codes), codes
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors  # from rank 0 (hosta) alone
    assert "--save-steps 2 needs one --output-dir that every host sees" in errors[0]
    assert "rank 1 (host hostb)" in errors[0] and "rank 0 (host hosta)" in errors[0]
    assert files_under(tmp_path) == []  # no checkpoint, no export, no lock left


def test_another_copy_of_the_data_on_one_host_is_refused(tmp_path, tiny_model):
    """Without a shared disk each host reads its own copy: one edited line on hostb would give
    every rank other batches than the run's, silently."""
    rows = [
        json.loads(line) for line in Path(data_file("sick-triplets-train.jsonl")).read_text().splitlines()
    ]
    rows[-1]["anchor"] += " (edited)"
    edited = tmp_path / "hostb-copy.jsonl"
    edited.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [*common_args(tiny_model), "--strategy", "fsdp", "--fsdp-version", "2"]
    args_b = [*args, "--train-data", edited, "--output-dir", tmp_path / "b"]  # the later flag wins
    with two_hosts.TwoHosts() as hosts:
        codes, outputs, _ = run_two_hosts(hosts, [*args, "--output-dir", tmp_path / "a"], args_b)
    assert all(code != 0 for code in codes), codes
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert f"--train-data {edited} on host hostb (rank 1) is not the data rank 0 reads" in errors[0]
    assert "Copy the same files to every host" in errors[0]
    assert [f for f in files_under(tmp_path) if f != edited.name] == []


def test_hybrid_shard_across_hosts_trains_as_one_host_and_halves_the_traffic(
    tmp_path, tiny_model, one_host_world_2
):
    """FSDP2 at 2 hosts x 2 processes, without a shared disk: two ranks send their shards from
    hostb to rank 0 for the export."""
    sent = {}
    for sharding in ("hybrid_shard", "full_shard"):
        out_a, out_b = tmp_path / sharding / "a", tmp_path / sharding / "b"
        args = [*common_args(tiny_model, grad_accum_steps=1), "--strategy", "fsdp", "--fsdp-version", "2"]
        args += ["--sharding", sharding, "--dist-timeout-minutes", 2]
        with two_hosts.TwoHosts() as hosts:
            before = hosts.wire_bytes()
            codes, outputs, _ = run_two_hosts(
                hosts, [*args, "--output-dir", out_a], [*args, "--output-dir", out_b], nproc=2
            )
            sent[sharding] = hosts.wire_bytes() - before
        assert codes == [0, 0], outputs
        assert_exported_as_one_host(out_a, out_b, outputs, one_host_world_2, sharding)
    # Hybrid: parameters are gathered and gradients reduce-scattered within a host; only the
    # gradient all-reduce of each shard crosses the cable (and, in both runs, the export's shards).
    print("bytes over the cable", sent, "hybrid/full", sent["hybrid_shard"] / sent["full_shard"])
    assert sent["hybrid_shard"] <= 0.5 * sent["full_shard"], sent


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_lost_host_stops_every_process_with_an_error_line(tmp_path, tiny_model, rendezvous):
    """hostb's cable is pulled after the step-2 checkpoint. Each host's rank names the other (hosta
    its silent peer; hostb the store on hosta, which it cannot reach), exits 4, and its launcher
    ends by itself with torchrun's 1 and its own error file's code 4, with no traceback but
    torchrun's failure report: under the static rendezvous on both hosts. Under c10d, hostb's
    torchrun sits in a call to the store on hosta that nothing interrupts (minutes); its rank
    kills it (SIGKILL) 10 s after its own exit, once it is clear that torchrun did not collect it,
    and writes the code to torchrun's error file first (docs/multi-node.md)."""
    out = tmp_path / "shared"
    args = [*common_args(tiny_model, steps=100000), "--strategy", "fsdp", "--fsdp-version", "2"]
    args += ["--save-steps", 2, "--output-dir", out, "--dist-timeout-minutes", 0.15]
    error_files = [tmp_path / "hosta.json", tmp_path / "hostb.json"]
    env = [{"TORCHELASTIC_ERROR_FILE": str(f)} for f in error_files]
    with two_hosts.TwoHosts() as hosts:
        procs = hosts.torchrun([*TRAIN, *args], nproc=1, env=env, rendezvous=rendezvous)
        deadline = time.monotonic() + 180
        while not checkpoints.complete_checkpoints(out / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), "the run ended before the cable was pulled"
        hosts.link_down(1)
        codes, outputs, seconds = hosts.wait(procs, timeout=120)
    print(rendezvous, "every process stopped", seconds, "s after the cable was pulled; exit codes", codes)
    assert codes == ([1, 1] if rendezvous == "static" else [1, -signal.SIGKILL]), codes
    # gloo's timeout is 9 s; hostb's rank then tries the store for 5 s, and under c10d waits 10 s
    # for its torchrun to collect its exit.
    assert seconds <= 9 + 30, seconds
    for host, (_, err), error_file in zip(("hosta", "hostb"), outputs, error_files):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, err[-3000:]
        print(errors[0])
        assert re.match(rf"error: rank \d on host {host} lost contact with the other ranks \(", errors[0])
        # gloo's words for its timeout: where a recv waited, or where another wait closed the pair.
        timed_out = ("Timed out waiting 9000ms", "Application timeout caused pair closure")
        assert any(t in errors[0] for t in timed_out) and "--dist-timeout-minutes 0.15" in errors[0]
        assert "Newest complete checkpoint: " + str(out / "checkpoints" / "step-") in errors[0]
        peer = "rank 1 on host hostb (pid " if host == "hosta" else "the rendezvous store on host hosta"
        assert peer in errors[0], errors[0]
        assert json.loads(error_file.read_text())["message"]["errorCode"] == 4, err[-3000:]
        assert "SignalException" not in err and "got signal" not in err, err[-3000:]
        tracebacks = err.split("Traceback (most recent call last)")[1:]
        if host == "hostb" and rendezvous == "c10d":
            assert tracebacks == [], err[-3000:]  # killed: no report of its own
        else:  # torchrun's own report of a failed worker, nothing else
            assert len(tracebacks) == 1 and "ChildFailedError" in tracebacks[0], err[-3000:]
    for _, path, problem in checkpoints.list_checkpoints(out / "checkpoints"):
        assert problem is None, (path, problem)  # a save cut by the lost host left no step-N folder


def test_a_worker_killed_on_one_host_heals_across_hosts(tmp_path, tiny_model, one_host_world_2):
    out = tmp_path / "shared"
    args = [*common_args(tiny_model), "--strategy", "fsdp", "--fsdp-version", "2", "--save-steps", 2]
    args += ["--resume", "auto", "--output-dir", out, "--dist-timeout-minutes", 1]
    kill = str(REPO_DIR / "tests" / "kill_launcher.py")
    with two_hosts.TwoHosts() as hosts:
        # Rank 1 (on hostb: c10d ranks the hosts by name) dies as soon as step 2's checkpoint is
        # complete, on the first attempt.
        procs = hosts.torchrun([kill, "after-save:2:1", *args], nproc=1, max_restarts=1)
        codes, outputs, _ = hosts.wait(procs, timeout=300)
    assert codes == [0, 0], outputs
    assert "resuming from" in outputs[0][0] + outputs[0][1]
    assert_same_training(out, one_host_world_2, NUM_STEPS)
    print("healed: largest weight difference to one host", largest_difference(out, one_host_world_2))


ELASTIC_STEPS = 60


def test_an_elastic_launch_goes_on_without_a_lost_host(tmp_path, tiny_model):
    """hostb's cable is pulled once a checkpoint is complete. hosta's rank stops with its error
    line (gloo's 9 s), torchrun restarts it (--max-restarts), the rendezvous meets with hosta
    alone (--nnodes 1:2; last_call_timeout 5 s), and --resume auto continues from the newest
    checkpoint at world 1 with 2 accumulation steps for the 2 processes it lost: the same rows,
    micro-batch by micro-batch, so it ends on the weights of the unbroken run at world 2."""
    args = [*common_args(tiny_model, grad_accum_steps=1, steps=ELASTIC_STEPS), "--strategy", "fsdp"]
    args += [
        "--per-device-batch-size",
        4,
        "--save-steps",
        5,
        "--resume",
        "auto",
        "--dist-timeout-minutes",
        0.15,
    ]
    reference = tmp_path / "one-host"
    warm_run([*args, "--output-dir", reference], nproc=2)
    out = tmp_path / "shared"
    with two_hosts.TwoHosts() as hosts:
        procs = hosts.torchrun(
            [*TRAIN, *args, "--output-dir", out],
            nproc=1,
            max_restarts=2,
            nnodes="1:2",
            rdzv_conf=["last_call_timeout=5"],
        )
        deadline = time.monotonic() + 180
        while not checkpoints.complete_checkpoints(out / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.poll() is None for p in procs), "the run ended before the cable was pulled"
        hosts.link_down(1)
        codes, outputs, seconds = hosts.wait(procs[:1], timeout=240)
    assert codes == [0], outputs
    text = outputs[0][0] + outputs[0][1]
    print("hosta finished alone", seconds, "s after the cable was pulled")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost contact with the other ranks" in errors[0], errors
    assert "torchrun restarts this host's processes (restart 1 of 2)" in errors[0], errors[0]
    resumed = re.search(r"resuming from (\S+)/step-(\d+) \(step \d+ of 60\)", text)
    assert resumed, text[-3000:]
    step = int(resumed.group(2))
    assert "resuming at 1 processes (the checkpoint: 2): per-device batch 4, accumulation 2" in text
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["world_size"]) for r in rows if "loss" in r]
    assert steps == [(s, 2 if s <= step else 1) for s in range(1, ELASTIC_STEPS + 1)], steps
    assert_same_training(out, reference, ELASTIC_STEPS)
    print(
        "resumed from step", step, "at world 1; largest weight difference", largest_difference(out, reference)
    )
