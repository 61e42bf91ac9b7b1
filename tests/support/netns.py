"""A real slow link for tests and benchmarks: Linux network namespaces joined by veth pairs
whose bandwidth ``tc ... tbf`` limits (``netem`` is not available on these machines).

Topology: a hub. One namespace, ``tier``, holds a bridge (``br0``, the first address of a
private /24); every member (``producer``, ``consumer``, ...) is a namespace of its own with one
interface, ``eth0``, the far end of a veth pair whose near end is a port of the bridge. The
tier's servers (redis-server, SeaweedFS) listen on the bridge's address. A member's link is
shaped on both ends, each end's egress: ``eth0`` (member -> tier) and the bridge port (tier ->
member), so the link is slow both ways and traffic between two members crosses both of their
links, as two machines reaching each other through a switch do. A hub rather than point-to-
point pairs: one subnet, every member reaches every other and the tier without routes, and a
member's bandwidth is a property of its own link (the bench varies one rate for all).

Processes run inside a namespace two ways: :meth:`Hub.popen` (``ip netns exec NS argv``, in a
session of its own, stopped when the hub closes), and :meth:`Hub.call_in`, which runs a Python
callable on a fresh thread that has entered the namespace (``setns``; a network namespace is
a per-thread attribute on Linux). Sockets that thread opens, threads it starts and processes
it spawns all live in the namespace, so ``hub.call_in("tier", Server, dir, host=...)`` starts
a real redis-server inside the tier. :func:`measure_tcp` times a TCP transfer between two
namespaces with plain sockets (an iperf of its own): the proof that a link is as slow as its
``tbf`` says.

Names are unique per hub (the process id and a random suffix), so parallel tests never meet.
Closing the hub (also on a failure while building it) stops what it started, kills whatever
still runs inside its namespaces and deletes them, which deletes their interfaces. Where
namespaces cannot be made (not root, no ``ip``, a container without the capability),
:func:`require_netns` skips the test with the reason.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
SUBNET = "10.77.0"  # private; each hub's namespaces have routing tables of their own
TIER = "tier"
_PROBED: list[str | None] = []  # the cached answer of unavailable_reason()
_LIBC = None


@dataclass(frozen=True, kw_only=True)
class Shaping:
    """A ``tbf`` shaping of one direction of a link: ``rate_mbit`` megabits (1e6 bits) per
    second, a bucket of ``burst_bytes`` (default: 10 ms at the rate, at least 64 KiB, above
    what the kernel's timer granularity needs) and ``latency_ms`` of queueing before drops."""

    rate_mbit: float
    burst_bytes: int | None = None
    latency_ms: float = 50.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate_mbit, int | float) and 0 < self.rate_mbit < 100_000):
            raise ValueError(f"rate_mbit must be in (0, 100000), got {self.rate_mbit!r}")
        if self.burst_bytes is not None and self.burst_bytes < 1500:
            raise ValueError(f"burst_bytes must be at least one packet (1500), got "
                             f"{self.burst_bytes!r}")
        if not self.latency_ms > 0:
            raise ValueError(f"latency_ms must be positive, got {self.latency_ms!r}")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def bucket_bytes(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(64 << 10, int(self.rate_bytes_per_s / 100))

    def tbf_args(self) -> list[str]:
        """``tc qdisc add dev X root`` + these."""
        return ["tbf", "rate", f"{self.rate_mbit * 1000:.0f}kbit", "burst",
                str(self.bucket_bytes), "latency", f"{self.latency_ms:g}ms"]

    def describe(self) -> str:
        return (f"tbf rate {self.rate_mbit:g} Mbit/s burst {self.bucket_bytes} B latency "
                f"{self.latency_ms:g} ms")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def unavailable_reason() -> str | None:
    """Why namespaces with tbf links cannot be made here (None: they can). Probed once per
    process: a namespace, a veth pair into it, a tbf qdisc, all deleted again."""
    if _PROBED:
        return _PROBED[0]
    reason = None
    if not os.path.exists("/proc/self/ns/net"):
        reason = "network namespaces need Linux"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "the `ip` and `tc` commands (iproute2) are not installed"
    elif os.geteuid() != 0:
        reason = "making network namespaces needs root"
    else:
        probe = f"kvprobe{os.getpid()}{secrets.token_hex(3)}"
        try:
            _run("ip", "netns", "add", probe)
            try:
                _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name",
                     "p1")
                _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root",
                     *Shaping(rate_mbit=100).tbf_args())
            finally:
                _run("ip", "netns", "del", probe, check=False)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            reason = f"cannot make a network namespace with a tbf-shaped veth here: {e}"
    _PROBED.append(reason)
    return reason


def require_netns() -> None:
    """Skip the calling test, with the reason, where :class:`Hub` cannot be built."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if _LIBC.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(kw_only=True)
class _Member:
    name: str
    index: int
    shaping: Shaping | None
    netns: str = ""
    address: str = ""


@dataclass(kw_only=True)
class Hub:
    """Namespaces joined through the tier's bridge (see the module's docstring). ``members``
    maps each member's name to its link's shaping (None: unshaped). A context manager:
    built on enter, torn down on exit. Not thread-safe to build or close; :meth:`call_in`,
    :meth:`popen` and the read-only accessors may be called from any thread."""

    members: dict[str, Shaping | None]
    tag: str = field(default_factory=lambda: f"kv{os.getpid()}{secrets.token_hex(3)}")
    _members: dict[str, _Member] = field(default_factory=dict, init=False)
    _made: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("members must name at least one namespace")
        if TIER in self.members:
            raise ValueError(f"{TIER!r} is the hub's own namespace, not a member name")
        if len(self.members) > 200:
            raise ValueError(f"at most 200 members, got {len(self.members)}")
        for i, (name, shaping) in enumerate(self.members.items()):
            if not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"member names must be identifiers, got {name!r}")
            if shaping is not None and not isinstance(shaping, Shaping):
                raise TypeError(f"members[{name!r}] must be a Shaping or None")
            self._members[name] = _Member(name=name, index=i, shaping=shaping)

    # --- building and tearing down -------------------------------------------------------

    def __enter__(self) -> Hub:
        require_netns()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        tier = self.netns(TIER)
        self._add_netns(tier)
        _run("ip", "-n", tier, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", tier, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        _run("ip", "-n", tier, "link", "set", "br0", "up")
        for m in self._members.values():
            m.netns = f"{self.tag}-{m.name}"
            m.address = f"{SUBNET}.{m.index + 2}"
            self._add_netns(m.netns)
            port = f"v{m.index}"
            _run("ip", "-n", tier, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", m.netns)
            _run("ip", "-n", tier, "link", "set", port, "master", "br0")
            _run("ip", "-n", tier, "link", "set", port, "up")
            _run("ip", "-n", m.netns, "addr", "add", f"{m.address}/24", "dev", "eth0")
            _run("ip", "-n", m.netns, "link", "set", "eth0", "up")
            if m.shaping is not None:
                for ns, dev in ((m.netns, "eth0"), (tier, port)):
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                         *m.shaping.tbf_args())

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Stop the processes :meth:`popen` started, kill anything else still inside the
        namespaces, delete them (their interfaces go with them). Idempotent."""
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            _stop_group(p)
        for ns in reversed(self._made):
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # only processes inside this hub's own namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()

    # --- where things are ----------------------------------------------------------------

    def netns(self, name: str) -> str:
        """The namespace name of member ``name`` (or of the tier, ``"tier"``)."""
        if name == TIER:
            return f"{self.tag}-{TIER}"
        return self._member(name).netns

    def address(self, name: str) -> str:
        """The IPv4 address of member ``name`` (the tier's: its bridge's)."""
        if name == TIER:
            return f"{SUBNET}.1"
        return self._member(name).address

    def shaping(self, name: str) -> Shaping | None:
        return self._member(name).shaping

    def _member(self, name: str) -> _Member:
        try:
            return self._members[name]
        except KeyError:
            raise ValueError(f"no member {name!r} (members: {sorted(self._members)}, "
                             f"and {TIER!r})") from None

    def describe(self) -> dict[str, object]:
        """The link as JSON for a benchmark's report."""
        return {"topology": "hub: a bridge in the tier namespace, one veth per member, tbf on "
                            "both ends' egress",
                "members": {n: {"address": m.address, "namespace": m.netns,
                                "shaping": None if m.shaping is None else m.shaping.describe()}
                            for n, m in self._members.items()},
                "tier": {"address": self.address(TIER), "namespace": self.netns(TIER)}}

    # --- running things inside -------------------------------------------------------------

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.netns(name), *argv]

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``name``'s namespace, in a session of its own; the hub stops
        it (SIGTERM to its group, then SIGKILL) when it closes, if the caller did not."""
        p = subprocess.Popen(self.exec_argv(name, argv), start_new_session=True, **kw)
        with self._lock:
            self._procs.append(p)
        return p

    def call_in(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a fresh thread inside ``name``'s namespace; its result,
        or its exception raised here. What it opens (sockets, threads, processes) stays in
        that namespace."""
        path = os.path.join(NETNS_DIR, self.netns(name))
        out: dict[str, Any] = {}

        def body() -> None:
            try:
                _setns(path)
                out["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller, raised there
                out["error"] = e

        t = threading.Thread(target=body, name=f"netns-{name}")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def set_shaping(self, name: str, shaping: Shaping) -> None:
        """Change member ``name``'s link to ``shaping``, both ends, in place (``tc qdisc
        replace``: connections stay open; a bandwidth sweep needs no restart)."""
        m = self._member(name)
        if not isinstance(shaping, Shaping):
            raise TypeError("shaping must be a Shaping")
        for ns, dev in ((m.netns, "eth0"), (self.netns(TIER), f"v{m.index}")):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                 *shaping.tbf_args())
        m.shaping = shaping

    def qdisc_sent_bytes(self, name: str) -> dict[str, int]:
        """Bytes each end of member ``name``'s link has sent through its tbf qdisc:
        ``{"up": member -> tier, "down": tier -> member}`` (the kernel's own counters)."""
        m = self._member(name)
        if m.shaping is None:
            raise ValueError(f"member {name!r} has no shaped link")
        out = {}
        for side, ns, dev in (("up", m.netns, "eth0"), ("down", self.netns(TIER),
                                                        f"v{m.index}")):
            stats = json.loads(_run("ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc",
                                    "show", "dev", dev).stdout)
            (tbf,) = [q for q in stats if q.get("kind") == "tbf"]
            out[side] = int(tbf["bytes"])
        return out


def _stop_group(p: subprocess.Popen, wait_s: float = 5.0) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    except ProcessLookupError:
        pass


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One TCP transfer: ``nbytes`` received in ``seconds`` (first byte to last)."""

    nbytes: int
    seconds: float

    @property
    def mbit_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6


def measure_tcp(hub: Hub, src: str, dst: str, nbytes: int, *, timeout_s: float = 60.0
                ) -> Measurement:
    """Send ``nbytes`` over one TCP connection from ``src``'s namespace to a receiver in
    ``dst``'s (member names or ``"tier"``); the receiver times from its first byte to its
    last, so connection setup and the tbf bucket's first burst (at most ``burst_bytes``)
    weigh little once ``nbytes`` is many times the burst."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    listener = hub.call_in(dst, socket.create_server, (hub.address(dst), 0))
    port = listener.getsockname()[1]
    result: dict[str, Any] = {}

    def receive() -> None:
        try:
            listener.settimeout(timeout_s)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(timeout_s)
                got, first, last = 0, None, None
                while True:
                    b = conn.recv(1 << 20)
                    if not b:
                        break
                    last = time.perf_counter()
                    first = first if first is not None else last
                    got += len(b)
            result["m"] = (got, (last or 0.0) - (first or 0.0))
        except OSError as e:
            result["error"] = e
        finally:
            listener.close()

    rx = threading.Thread(target=receive, name="measure-rx")
    rx.start()

    def send() -> None:
        block = bytes(1 << 16)
        with socket.create_connection((hub.address(dst), port), timeout=timeout_s) as s:
            left = nbytes
            while left > 0:
                left -= s.send(block[: min(left, len(block))])

    try:
        hub.call_in(src, send)
    finally:
        rx.join(timeout_s)
    if "error" in result:
        raise result["error"]
    got, seconds = result["m"]
    if got != nbytes:
        raise RuntimeError(f"the receiver got {got} bytes of {nbytes}")
    return Measurement(nbytes=got, seconds=seconds)
