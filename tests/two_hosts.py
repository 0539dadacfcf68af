"""Two hosts on this machine, for the multi-node tests and benchmark: each a network + UTS
namespace with its own hostname and its own address, the two joined by a veth pair (a cable).

    with two_hosts.TwoHosts() as hosts:          # needs root and iproute2's `ip` (see `why_not`)
        procs = hosts.torchrun(["-m", "fsdp_embed", ...], nproc=2)
        hosts.wire_bytes()                       # bytes that crossed the cable so far

Each host resolves both names through /etc/netns/NAME/hosts (what `ip netns exec` shows as its
/etc/hosts), so torchrun's c10d rendezvous finds its store by the name `hosta`, as on a real
cluster, and gloo binds to the host's own cable (GLOO_SOCKET_IFNAME). The addresses come from
192.0.2.0/24, a documentation range that exists only inside the namespaces made here: nothing
is sent to any other address. `close()` (also on an exception or timeout) kills what runs in
the namespaces and removes the namespaces, the cable and the hosts files.

The file system is not separated: two hosts without a shared disk are two hosts given
different --output-dir folders (which is all a run can tell apart).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]


def why_not():
    """None when namespaces can be made here, else the reason (for pytest.skip)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"fe-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoHosts:
    """hosta (192.0.2.X+1) and hostb (X+2) on one cable; X from the pid, so runs side by side differ."""

    HOSTNAMES = ("hosta", "hostb")

    def __init__(self):
        tag = os.getpid() % 100000
        self.netns = [f"fe{tag}-a", f"fe{tag}-b"]
        self.links = [f"fe{tag}a", f"fe{tag}b"]  # interface names: 15 characters at most
        base = 4 * (tag % 60) + 4
        self.addresses = [f"192.0.2.{base + 1}", f"192.0.2.{base + 2}"]
        self.procs = []
        self.made = False

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _make(self):
        self.made = True
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {name}\n" for addr, name in zip(self.addresses, self.HOSTNAMES)
        )
        for ns in self.netns:
            self._ip("netns", "add", ns)
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts_file)
        self._ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, addr in zip(self.netns, self.links, self.addresses):
            self._ip("link", "set", link, "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            self._ip("-n", ns, "link", "set", link, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def command(self, host, argv):
        """argv run on host 0 or 1: in its namespace, under its own hostname."""
        return [
            "ip",
            "netns",
            "exec",
            self.netns[host],
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {self.HOSTNAMES[host]} && exec "$@"',
            "sh",
            *argv,
        ]

    def start(self, host, argv, env=None, cwd=REPO_DIR):
        """Start argv on a host (its own session, so close() can end all it started)."""
        proc = subprocess.Popen(
            self.command(host, argv),
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def torchrun(
        self,
        script_args,
        nproc,
        env=None,
        max_restarts=0,
        port=29400,
        job="fsdp-embed",
        rendezvous="c10d",
        nnodes="2",
        rdzv_conf=(),
    ):
        """One torchrun per host, as on a cluster: the rendezvous at hosta:PORT (c10d, or static:
        --master-addr and each host's --node-rank), gloo on each host's cable. `script_args` is a
        list per host, or one list for both; `nnodes` "1:2" makes the launch elastic, `rdzv_conf`
        its --rdzv-conf settings. Returns the two Popen objects (see `wait`)."""
        procs = []
        for host in (0, 1):
            args = script_args[host] if isinstance(script_args[0], list) else script_args
            if rendezvous == "static":
                meet = [f"--master-addr={self.HOSTNAMES[0]}", f"--master-port={port}", f"--node-rank={host}"]
            else:
                meet = [f"--rdzv-endpoint={self.HOSTNAMES[0]}:{port}", f"--rdzv-id={job}"]
                meet += [f"--rdzv-conf={','.join(rdzv_conf)}"] if rdzv_conf else []
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc}",
                f"--rdzv-backend={rendezvous}",
                *meet,
                f"--max-restarts={max_restarts}",
                *[str(a) for a in args],
            ]
            host_env = env[host] if isinstance(env, list) else env  # one dict per host, or one for both
            host_env = {"GLOO_SOCKET_IFNAME": self.links[host], "OMP_NUM_THREADS": "1", **(host_env or {})}
            procs.append(self.start(host, argv, env=host_env))
        return procs

    def wait(self, procs, timeout):
        """(returncodes, outputs, seconds) once every proc has ended; kills them all at `timeout`."""
        start = time.monotonic()
        outputs = []
        for proc in procs:
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                outputs.append(proc.communicate(timeout=left))
            except subprocess.TimeoutExpired:
                self.kill_all()
                outputs.append(proc.communicate())
        return [p.returncode for p in procs], outputs, time.monotonic() - start

    def wire_bytes(self):
        """Bytes sent over the cable so far, both directions (hosta's sent + hostb's sent)."""
        total = 0
        for ns, link in zip(self.netns, self.links):
            out = subprocess.run(
                ["ip", "-n", ns, "-j", "-s", "link", "show", link], check=True, capture_output=True, text=True
            ).stdout
            total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
        return total

    def link_down(self, host):
        """Pull the cable out of a host: packets to and from it are lost from now on."""
        self._ip("-n", self.netns[host], "link", "set", self.links[host], "down")

    def throttle(self, rate):
        """Limit each direction of the cable to `rate` (tc's units, e.g. "1gbit", "500mbit")."""
        for ns, link in zip(self.netns, self.links):
            self._ip(
                "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "tbf",
                "rate", rate, "burst", "1mbit", "latency", "100ms",
            )  # fmt: skip

    def kill_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self):
        self.kill_all()
        for proc in self.procs:
            try:
                proc.communicate(timeout=30)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        # Anything still inside a namespace (a worker that left its session) dies with it.
        for ns in self.netns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its end of the cable
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.links[0]], capture_output=True)  # if never moved
