"""Two network namespaces joined by one rate-limited veth pair: an emulated 2-node link.

Why namespaces: every process launched in a namespace sees only that namespace's
interfaces (its own loopback and one end of the veth pair), so traffic between
processes of one "node" stays on that node's loopback while traffic between nodes
must cross the veth pair, where `tc` limits its rate and the kernel counts its bytes.
Nothing here can reach outside the machine: the veth pair is the namespaces' only
non-loopback interface and has no route anywhere else.

Naming: every object carries ``PREFIX + <owner pid> + <random tag>`` so parallel runs
never collide and a sweep can find (and delete) the leftovers of dead owners.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "mqemu"             # namespace names: mqemu<pid>x<tag>a / ...b
_NS_RE = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]+)([abp])$")   # p: availability probe
SUBNET = "10.77.0"           # private addresses that exist only inside our namespaces


class NetnsError(RuntimeError):
    """The machine cannot build the emulated link; the message says why and what to do."""


def _checked(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def why_unavailable() -> str | None:
    """None when this machine can build namespaces, else a one-line reason."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a privileged container)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)"
    # Try the real thing on a throw-away namespace: some containers allow namespaces
    # but not veth pairs or tbf.
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}p"
    steps = [(["ip", "netns", "add", probe], "`ip netns add` is not permitted here"),
             (["ip", "-n", probe, "link", "add", "mqprobe0", "type", "veth", "peer", "name",
               "mqprobe1"], "veth pairs cannot be created here"),
             (["tc", "-n", probe, "qdisc", "add", "dev", "mqprobe0", "root", "tbf", "rate",
               "1mbit", "burst", "32kb", "latency", "50ms"],
              "tc cannot add a tbf qdisc here (kernel without CONFIG_NET_SCH_TBF?)")]
    try:
        for cmd, why in steps:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                return f"{why}: {p.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def rate_to_bits(rate: str) -> float:
    """'100mbit' / '1gbit' / '500kbit' / '2e8' (bits/s) -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmg]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"bad link rate {rate!r}: write e.g. 100mbit, 1gbit or 500kbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if m.group(3) == "bps":   # tc's bytes-per-second spelling
        scale *= 8
    bits = float(m.group(1)) * scale
    if bits < 8000:
        raise ValueError(f"link rate {rate!r} is below 8 kbit/s: pick a rate such as 100mbit")
    return bits


def delay_to_ms(delay: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)?\s*", delay.lower())
    if not m:
        raise ValueError(f"bad link delay {delay!r}: write e.g. 0.5ms, 200us or 0")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, None: 1.0}[m.group(2)]


def qdisc_supported(netns: str, dev: str, kind: str, *params: str) -> bool:
    """Try adding a qdisc kind on a scratch device (kernels ship different sets)."""
    p = subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", kind, *params],
                       capture_output=True, text=True)
    if p.returncode == 0:
        subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
    return p.returncode == 0


@dataclass
class LinkCounters:
    """Kernel byte/packet counters of one interface (what `ip -s link` shows)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                            self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


@dataclass
class EmulatedLink:
    """Namespaces ``ns[0]``, ``ns[1]`` with veth ends ``dev[0]``, ``dev[1]``.

    Use as a context manager: entering builds the link, leaving (normally, on an
    exception, or on KeyboardInterrupt) kills what runs inside and deletes both
    namespaces, which also destroys the veth pair.
    """

    rate: str = "1gbit"
    delay: str = "0ms"
    mtu: int = 1500
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    shaping: dict = field(default_factory=dict)   # what tc actually applied, for the record

    def __post_init__(self):
        base = f"{PREFIX}{os.getpid()}x{self.tag}"
        self.ns = [base + "a", base + "b"]
        # interface names: at most 15 characters, unique per run; each lives in its own ns
        short = f"mq{os.getpid() % 100000}{self.tag[:4]}"
        self.dev = [short + "a", short + "b"]
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.rate_bits = rate_to_bits(self.rate)
        self.delay_ms = delay_to_ms(self.delay)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "EmulatedLink":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        for ns in self.ns:
            _checked(["ip", "netns", "add", ns])
        # Create the pair inside the first namespace, then move one end: the host's
        # own namespace never holds either end, not even briefly.
        _checked(["ip", "-n", self.ns[0], "link", "add", self.dev[0], "mtu", str(self.mtu),
                  "type", "veth", "peer", "name", self.dev[1], "mtu", str(self.mtu)])
        _checked(["ip", "-n", self.ns[0], "link", "set", self.dev[1], "netns", self.ns[1]])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            _checked(["ip", "-n", ns, "link", "set", "lo", "up"])
            _checked(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _checked(["ip", "-n", ns, "link", "set", dev, "up"])
        for ns, dev in zip(self.ns, self.dev):
            self.shaping = self._shape(ns, dev)
        # One idle process per namespace: its /proc/PID/net/dev shows the namespace's
        # counters, readable from here without a subprocess (fast enough to sample
        # at every training iteration).
        self._holders = [subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "infinity"],
                                          stdin=subprocess.DEVNULL, start_new_session=True)
                         for ns in self.ns]
        deadline = time.time() + 10
        for node in (0, 1):   # wait until each holder has entered its namespace
            while True:
                try:
                    self.counters(node)
                    break
                except NetnsError:
                    if time.time() > deadline or self._holders[node].poll() is not None:
                        raise
                    time.sleep(0.01)

    def _shape(self, ns: str, dev: str) -> dict:
        """Egress shaping on one end (both ends get it: a full-duplex link of `rate`).

        tbf limits the rate; netem, when the kernel has it, adds the one-way delay.
        Kernels built without sch_netem (some VM kernels) get the rate only, and the
        record says so instead of pretending.
        """
        tbf, burst = self._tbf()
        netem_ok = self.delay_ms > 0 and qdisc_supported(ns, dev, "netem", "delay", "1ms")
        if netem_ok:
            _checked(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                      "netem", "delay", f"{self.delay_ms}ms", "limit", "100000"])
            _checked(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1",
                      "handle", "10:", *tbf])
        else:
            _checked(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])
        return {"rate_bits": self.rate_bits, "burst_bytes": burst, "mtu": self.mtu,
                "delay_ms_requested": self.delay_ms,
                "delay_ms_applied": self.delay_ms if netem_ok else 0.0,
                "note": "" if netem_ok or self.delay_ms == 0 else
                "kernel lacks sch_netem: delay not applied, rate limit only"}

    def _tbf(self) -> tuple[list[str], int]:
        rate_bytes = self.rate_bits / 8
        # burst: enough tokens for ~1 ms at line rate (timer granularity) and a few
        # 64 KiB GSO super-packets, so tbf does not throttle below the nominal rate.
        burst = int(max(4 * 65536, rate_bytes * 1e-3))
        return ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst),
                "latency", "100ms"], burst

    def set_rate(self, rate: str) -> None:
        """Change the link's rate in place (both directions), e.g. between iterations."""
        self.rate, self.rate_bits = rate, rate_to_bits(rate)
        tbf, burst = self._tbf()
        where = (["parent", "1:1", "handle", "10:"] if self.shaping.get("delay_ms_applied")
                 else ["root", "handle", "1:"])
        for ns, dev in zip(self.ns, self.dev):
            _checked(["tc", "-n", ns, "qdisc", "change", "dev", dev, *where, *tbf])
        self.shaping.update(rate_bits=self.rate_bits, burst_bytes=burst)

    def destroy(self) -> None:
        for ns in self.ns:
            delete_namespace(ns)
        for h in getattr(self, "_holders", []):
            if h.poll() is None:
                h.kill()
            h.wait()

    # ------------------------------------------------------------------ use
    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node]]

    def counters(self, node: int, dev: str | None = None) -> LinkCounters:
        """Counters of this node's veth end (or `dev`, e.g. 'lo') in its namespace."""
        return read_net_dev(self._holders[node].pid, dev or self.dev[node])

    def ip_s_link(self, node: int) -> str:
        """`ip -s link show DEV` inside the namespace (for humans and logs)."""
        return _checked(["ip", "-n", self.ns[node], "-s", "link", "show", self.dev[node]]).stdout


def read_net_dev(pid: int, dev: str) -> LinkCounters:
    """Counters of `dev` in the network namespace of process `pid` (/proc/PID/net/dev:
    the same numbers as /sys/class/net/DEV/statistics and `ip -s link` inside it)."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                v = [int(x) for x in rest.split()]
                # rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets ...
                return LinkCounters(tx_bytes=v[8], rx_bytes=v[0], tx_packets=v[9], rx_packets=v[1])
    raise NetnsError(f"interface {dev} not found in the namespace of pid {pid}")


def delete_namespace(ns: str) -> None:
    """Kill every process still inside `ns`, then delete it (its veth end goes with it)."""
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    pids = [int(x) for x in p.stdout.split()] if p.returncode == 0 else []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in pids if _alive(pid)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue  # already gone: nothing to stop
        deadline = time.time() + 3
        while alive and time.time() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in alive if _alive(pid)]
        if not alive:
            break
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def list_namespaces() -> list[str]:
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def sweep_stale(owner_pid: int | None = None) -> list[str]:
    """Delete our namespaces whose owner process is gone (or owned by `owner_pid`)."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if (owner_pid is not None and pid == owner_pid) or (owner_pid is None and not _alive(pid)):
            delete_namespace(ns)
            removed.append(ns)
    return removed
