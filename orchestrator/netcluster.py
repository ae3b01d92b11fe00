"""A Ray cluster whose nodes are network namespaces of this machine: each node has its own network stack and
address on a bridge, so the traffic between workers crosses a link that can be measured, cut, rate-limited or
lost with its node, as between real nodes (tests/cluster/, `make cluster-demo`).

    root namespace: bridge aerie-br 198.51.100.1/24 (the test's own address; documentation range, RFC 5737)
      ├─ veth aerie-v-head   ──  namespace aerie-head    198.51.100.10  ray head (GCS, dashboard, Serve; 0 CPUs)
      ├─ veth aerie-v-target ──  namespace aerie-target  198.51.100.11  ray worker, resources {target: 1}
      └─ veth aerie-v-draft  ──  namespace aerie-draft   198.51.100.12  ray worker, resources {draft: 1}

The custom resources and node labels (aerie/group: the node's name) are the GB200 manifests'
(clusters/gb200-raycluster.yaml). Every Ray process of a node runs
in its namespace (`ip netns exec`), so killing a node is killing the processes of its namespace, and its veth's
counters are its link's bytes. Token authentication is on (the user's ~/.ray/auth_token, shared by all nodes).

Needs root with `ip netns` and veth/bridge links (`NetCluster.unavailable()` says why not). One NetCluster at a
time per machine (a lock file); a start first removes what a crashed one left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import AerieError

PREFIX = "aerie-"
BRIDGE = "aerie-br"
SUBNET = "198.51.100"  # TEST-NET-2 (RFC 5737): never a private range, never routed
HOST_IP = f"{SUBNET}.1"
GCS_PORT = 6379
DASHBOARD_PORT = 8265
GROUP_LABEL = "aerie/group"  # each node's Ray label: its name, as the GB200 node groups' (label_selector)
OBJECT_STORE_BYTES = 256 * 1024**2  # per node (Ray takes 30% of memory by default)
LOCK = Path("/run/aerie-netcluster.lock")
RAY = Path(sys.executable).parent / "ray"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise AerieError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


@dataclass
class Node:
    """One node: its namespace, address, the host side of its link, and what its raylet advertises."""

    name: str
    ip: str
    resources: dict = field(default_factory=dict)
    num_cpus: float = 1
    head: bool = False
    cores: tuple[int, ...] | None = None  # the CPU cores its processes may run on (None: any), as a machine's own

    @property
    def netns(self) -> str:
        return PREFIX + self.name

    @property
    def veth(self) -> str:  # the host side, on the bridge (<= 15 characters)
        return (PREFIX + "v-" + self.name)[:15]


class NetCluster:
    """A Ray head and worker nodes, each in its own network namespace on one bridge.

    with NetCluster(env) as cluster:          # env: the environment Ray's processes get (RAY_AUTH_MODE=token ...)
        cluster.add_node("target", {"target": 1})
        cluster.add_node("draft", {"draft": 1})
        cluster.run("head", [...])            # a command on a node (its own network)
        cluster.link("draft", up=False)       # cut the draft node off; its processes live on
        cluster.kill("draft")                 # every process of the node at once
        cluster.link_bytes("draft")           # {rx, tx}: bytes its link carried (as the node sees them)
    """

    def __init__(self, env: dict | None = None, head_cpus: float = 0, head_cores: tuple[int, ...] | None = None):
        self.env = dict(env or os.environ)
        self.nodes: dict[str, Node] = {}
        self._procs: list[subprocess.Popen] = []
        self._head_cpus, self._head_cores = head_cpus, head_cores
        self._lock = None

    # -- availability ----------------------------------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why no NetCluster can be made here (None: it can)."""
        if sys.platform != "linux":
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add)"
        probe = f"{PREFIX}probe{os.getpid()}"[:15]
        try:
            made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            return "no `ip` command (iproute2)"
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.nodes['head'].ip}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.nodes['head'].ip}:{DASHBOARD_PORT}"

    def __enter__(self) -> NetCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """The bridge, the host's address on it, and the head node."""
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = LOCK.open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise AerieError(f"another NetCluster runs on this machine ({LOCK} is locked)") from None
        _cleanup_leftovers()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        self._add(Node("head", f"{SUBNET}.10", {}, self._head_cpus, head=True, cores=self._head_cores))

    def stop(self) -> None:
        """Every node's processes, namespaces and links, and the bridge."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for node in list(self.nodes.values()):
            self.kill(node.name)
        _cleanup_leftovers()
        self.nodes.clear()
        _forget_noted_cluster()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def add_node(
        self, name: str, resources: dict | None = None, num_cpus: float = 1, cores: tuple[int, ...] | None = None
    ) -> Node:
        """A worker node joining the head (a new namespace; a killed node's name may be used again: the
        replacement gets the same address). `cores`: the CPU cores every process of the node may use (taskset),
        so that nodes do not take each other's CPU as separate machines would not."""
        if name in self.nodes and self.ray_alive(name):
            raise AerieError(f"node {name} is already running")
        old = self.nodes.pop(name, None)
        if old is not None:
            self._remove_netns(old)
        ip = old.ip if old is not None else f"{SUBNET}.{10 + len(self.nodes)}"
        return self._add(Node(name, ip, dict(resources or {}), num_cpus, cores=cores))

    def _add(self, node: Node) -> Node:
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", node.veth, "master", BRIDGE, "up")
        for args in (("addr", "add", f"{node.ip}/24", "dev", "eth0"), ("link", "set", "eth0", "up")):
            _ip("netns", "exec", node.netns, "ip", *args)
        _ip("netns", "exec", node.netns, "ip", "link", "set", "lo", "up")
        self.nodes[node.name] = node
        cmd = [str(RAY), "start", f"--node-ip-address={node.ip}", f"--num-cpus={node.num_cpus}"]
        cmd += [f"--object-store-memory={OBJECT_STORE_BYTES}"]
        cmd += [
            "--disable-usage-stats",
            "--resources",
            json.dumps(node.resources),
            f"--labels={GROUP_LABEL}={node.name}",
        ]
        if node.head:
            cmd += ["--head", f"--port={GCS_PORT}", f"--dashboard-host={node.ip}", f"--dashboard-port={DASHBOARD_PORT}"]
        else:
            cmd += [f"--address={self.address}"]
        # the node's processes inherit the raylet's environment: gloo (Ray Train on CPUs) listens on the address
        # the host name resolves to, which the namespaces share with the machine (loopback): name the interface
        env = self.env | {"GLOO_SOCKET_IFNAME": "eth0"}
        started = self.run(node.name, cmd, timeout=180, env=env)
        if started.returncode != 0:
            raise AerieError(f"ray start on node {node.name} failed: {started.stderr[-2000:]}")
        _forget_noted_cluster()
        return node

    # -- what runs on a node ---------------------------------------------------------------------------------

    def command(self, node: str, cmd: list[str]) -> list[str]:
        """`cmd` run in `node`'s network namespace (and on its cores, where it has its own)."""
        n = self.nodes[node]
        pin = ["taskset", "-c", ",".join(map(str, n.cores))] if n.cores else []
        return ["ip", "netns", "exec", n.netns, *pin, *cmd]

    def run(self, node: str, cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(node, cmd), env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kw
        )

    def popen(self, node: str, cmd: list[str], **kw) -> subprocess.Popen:
        """A long-running command on `node` (ended by `stop`, and with its node by `kill`)."""
        proc = subprocess.Popen(self.command(node, cmd), env=kw.pop("env", self.env), **kw)
        self._procs.append(proc)
        return proc

    def pids(self, node: str) -> list[int]:
        """Every process in the node's namespace."""
        return _netns_pids(self.nodes[node].netns)

    def alive(self, node: str) -> bool:
        """Whether any process of the node runs."""
        return bool(self.pids(node))

    def ray_alive(self, node: str) -> bool:
        """Whether the node's raylet runs (Ray ends a raylet that the cluster declared dead once it can tell it)."""
        import psutil

        for pid in self.pids(node):
            with contextlib.suppress(psutil.Error):
                if any(part.endswith("/raylet") for part in psutil.Process(pid).cmdline()):
                    return True
        return False

    # -- faults ----------------------------------------------------------------------------------------------

    def kill(self, node: str) -> int:
        """SIGKILL to every process of the node at once (raylet, object store, workers, actors): a node lost.
        Returns how many processes were killed."""
        return _kill_netns(self.nodes[node].netns)

    def link(self, node: str, up: bool) -> None:
        """The node's link up or down (down: cut off from every other node; its processes live on)."""
        _ip("link", "set", self.nodes[node].veth, "up" if up else "down")

    def rate_limit(self, node: str, mbit: float | None) -> None:
        """Both directions of the node's link limited to `mbit` Mbit/s (token bucket filter); None lifts it."""
        n = self.nodes[node]
        for argv in (["tc"], ["ip", "netns", "exec", n.netns, "tc"]):  # host side: to the node; node side: from it
            dev = n.veth if len(argv) == 1 else "eth0"
            subprocess.run([*argv, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            if mbit is not None:
                burst = max(16_000, int(mbit * 1e6 / 8 / 250))  # 4 ms of traffic at the rate, at least 16 kB
                limit = [*argv, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit"]
                proc = subprocess.run(
                    [*limit, "burst", str(burst), "latency", "50ms"], capture_output=True, text=True, timeout=30
                )
                if proc.returncode != 0:
                    raise AerieError(f"tc on {dev}: {proc.stderr.strip()}")

    def cpu_seconds(self, node: str) -> dict[int, float]:
        """CPU seconds (user + system) each live process of the node has used so far, by pid: the difference of
        two readings is the node's CPU time between them (`cpu_between`)."""
        import psutil

        out = {}
        for pid in self.pids(node):
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                out[pid] = t.user + t.system
        return out

    def link_bytes(self, node: str) -> dict[str, int]:
        """Bytes the node's link has carried, as the node sees them: rx (to it), tx (from it); Ethernet frames."""
        base = Path("/sys/class/net") / self.nodes[node].veth / "statistics"
        # the host side's tx is what the node received
        return {"rx": int((base / "tx_bytes").read_text()), "tx": int((base / "rx_bytes").read_text())}

    def probe(self, code: str):
        """Run `code` as a driver on the head (`ray` connected to the cluster, `json` imported); its last line of
        output read as JSON."""
        script = f"import json, ray\nray.init(address='{self.address}', log_to_driver=False)\n{code}"
        proc = self.run("head", [sys.executable, "-c", script], timeout=180)
        if proc.returncode != 0:
            raise AerieError(f"probe on the head failed: {proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def actors(self, alive: bool = True) -> list[tuple[str, str]]:
        """(class, node name) of every live actor (alive=False: also those that ended, as far as Ray remembers):
        which actor runs on which node."""
        names = {n.ip: n.name for n in self.nodes.values()}
        filters = [("state", "=", "ALIVE")] if alive else []
        code = (
            "from ray.util.state import list_actors\n"
            "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
            f"live = list_actors(address='{self.dashboard}', filters={filters!r}, limit=1000)\n"
            "print(json.dumps([(a.class_name, ips.get(a.node_id)) for a in live]))"
        )
        return sorted((cls, names.get(ip, str(ip))) for cls, ip in self.probe(code))

    def topology(self) -> list[dict]:
        """Each node: namespace, address, link, resources, alive."""
        return [
            {
                "node": n.name,
                "netns": n.netns,
                "ip": n.ip,
                "link": n.veth,
                "resources": n.resources,
                "alive": self.alive(n.name),
            }
            for n in self.nodes.values()
        ]

    @staticmethod
    def _remove_netns(node: Node) -> None:
        _kill_netns(node.netns)
        _ip("link", "del", node.veth, check=False)
        _ip("netns", "del", node.netns, check=False)


class ClusterServer:
    """`aerie serve` on the head node (in its namespace, as a driver on a head runs), its Serve config `config`
    with `overrides`; `url` as clients outside the cluster reach it. `stop()` ends it and shuts Serve down."""

    def __init__(self, cluster: NetCluster, config: str | Path, overrides: list[str], log: Path, port: int = 8000):
        self.cluster, self.log = cluster, Path(log)
        aerie = str(Path(sys.executable).parent / "aerie")
        cmd = [aerie, "serve", "--config", str(config), f"--address={cluster.address}", "--host=0.0.0.0"]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("w")
        self.proc = cluster.popen("head", [*cmd, f"--port={port}", *overrides], stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://{cluster.nodes['head'].ip}:{port}"

    def wait_healthy(self, headers: dict, timeout_s: float = 600) -> dict:
        """Until /health answers 200 (its JSON); an AerieError with the log's tail if the server exits or stays
        down."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AerieError(f"aerie serve exited: {self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=5, headers=headers)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AerieError(f"the server did not come up in {timeout_s:g} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutdown = f"import ray; from ray import serve; ray.init(address='{self.cluster.address}'); serve.shutdown()"
        self.cluster.run("head", [sys.executable, "-c", shutdown], timeout=180)


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """The CPU seconds a node's processes used between two `cpu_seconds` readings: each process alive at both by
    its difference, one started between them by all of its time (one that ended between them is not counted)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def ray_token_env() -> dict:
    """This environment with Ray's token authentication on (a token generated once per user, ~/.ray/auth_token,
    which every node of a NetCluster reads)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{RAY.parent}:{os.environ['PATH']}"}
    subprocess.run([str(RAY), "get-auth-token", "--generate"], env=env, capture_output=True, timeout=60)
    return env


def _cleanup_leftovers() -> None:
    """Remove every aerie- namespace (killing its processes), veth and the bridge (the lock says none is in use)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        if name.startswith(PREFIX):
            _kill_netns(name)
            _ip("netns", "del", name, check=False)
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    for line in links:
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            _ip("link", "del", name, check=False)


def _netns_pids(netns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]


def _kill_netns(netns: str) -> int:
    """SIGKILL to every process in the namespace; waits until they are gone. Returns how many there were."""
    pids = _netns_pids(netns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _netns_pids(netns) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(pids)


def _forget_noted_cluster() -> None:
    """`ray start --head` notes its cluster as the machine's latest, which a bare `ray.init()` elsewhere would join."""
    from ray._private.utils import get_ray_address_file, read_ray_address

    if (read_ray_address() or "").startswith(f"{SUBNET}."):
        Path(get_ray_address_file(None)).unlink(missing_ok=True)
