"""Real constrained links for a local deployment: network namespaces, veth pairs, ``tc``.

:class:`NetnsLab` builds, for a SuperLink and N SuperNodes, one network namespace each (named
``fc<token>-l`` and ``fc<token>-n<i>``, all created here and deleted at the end) and one veth pair
per SuperNode between the SuperLink's namespace and the node's, with addresses in 10.213.<i>.0/30
that exist only inside those namespaces (nothing is added to the host's own network). Rates are
real: a token bucket (``tc qdisc ... tbf``) on the SuperLink's end of the pair shapes the node's
downlink, one on the node's end its uplink. Latency needs ``sch_netem``; a kernel without it
(checked at setup) gets rate limits only and :attr:`NetnsLab.latency_emulated` is False.

Needs root (CAP_NET_ADMIN) and iproute2; :meth:`NetnsLab.setup` raises
:class:`NetnsUnavailable` with the reason otherwise, after removing whatever it had created.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence

from fedcomp.net.links import LinkProfile

__all__ = ["NetnsLab", "NetnsUnavailable"]

#: Port the SuperLink listens on inside its namespace (namespaces are fresh: no conflicts).
SUPERLINK_PORT = 9092
#: Port of each SuperNode's local Runtime API, inside the node's namespace.
SUPERNODE_PORT = 9094


class NetnsUnavailable(RuntimeError):
    """Network namespaces / tc cannot be used here (not root, no iproute2, kernel support)."""


def _run(cmd: Sequence[str], timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)


class NetnsLab:
    """Namespaces and shaped veth links for one SuperLink and ``len(links)`` SuperNodes."""

    def __init__(self, links: Sequence[LinkProfile], name: str | None = None) -> None:
        if not 1 <= len(links) <= 250:
            raise ValueError("NetnsLab: between 1 and 250 SuperNodes")
        self.links = list(links)
        self.name = name or "fc" + uuid.uuid4().hex[:6]
        self.created: list[str] = []
        self.latency_emulated = False

    # --- names and addresses -------------------------------------------------------------------

    @property
    def link_ns(self) -> str:
        return f"{self.name}-l"

    def node_ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    def superlink_address(self, i: int) -> str:
        """Where SuperNode ``i`` reaches the SuperLink (its end of the pair in the link namespace)."""
        return f"10.213.{i}.1:{SUPERLINK_PORT}"

    def exec_prefix(self, ns: str) -> list[str]:
        """Run a command inside namespace ``ns`` (``ip netns exec`` keeps the PID: exec in place)."""
        return [self._ip, "netns", "exec", ns]

    # --- setup / teardown ----------------------------------------------------------------------

    def _must(self, cmd: Sequence[str]) -> None:
        out = _run(cmd)
        if out.returncode != 0:
            raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {(out.stderr or out.stdout).strip()}")

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN)")
        ip, tc = shutil.which("ip"), shutil.which("tc")
        if ip is None or tc is None:
            raise NetnsUnavailable("iproute2 (`ip`, `tc`) is not installed")
        self._ip, self._tc = ip, tc
        try:
            for ns in (self.link_ns, *(self.node_ns(i) for i in range(len(self.links)))):
                self._must([ip, "netns", "add", ns])
                self.created.append(ns)
                self._must([ip, "-n", ns, "link", "set", "lo", "up"])
            self.latency_emulated = self._probe_netem()
            for i, link in enumerate(self.links):
                a, b, node = f"{self.name}a{i}", f"{self.name}b{i}", self.node_ns(i)
                self._must([ip, "-n", self.link_ns, "link", "add", a, "type", "veth", "peer", "name", b, "netns", node])
                self._must([ip, "-n", self.link_ns, "addr", "add", f"10.213.{i}.1/30", "dev", a])
                self._must([ip, "-n", node, "addr", "add", f"10.213.{i}.2/30", "dev", b])
                self._must([ip, "-n", self.link_ns, "link", "set", a, "up"])
                self._must([ip, "-n", node, "link", "set", b, "up"])
                self._shape(self.link_ns, a, link.downlink_mbps, link.latency_ms)  # towards the node
                self._shape(node, b, link.uplink_mbps, link.latency_ms)  # towards the SuperLink
        except BaseException:
            self.teardown()
            raise

    def _probe_netem(self) -> bool:
        """Whether this kernel has sch_netem (tried on the link namespace's loopback)."""
        cmd = [*self.exec_prefix(self.link_ns), self._tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        if _run(cmd).returncode != 0:
            return False
        _run([*self.exec_prefix(self.link_ns), self._tc, "qdisc", "del", "dev", "lo", "root"])
        return True

    def _shape(self, ns: str, dev: str, mbps: float, latency_ms: float) -> None:
        rate_bps = mbps * 1e6
        burst = max(3200, int(rate_bps / 8 / 100))  # 10 ms worth of bytes, at least two MTUs
        limit = max(4 * burst, int(rate_bps / 8 * 0.5))  # up to 0.5 s of queue
        tbf = ["tbf", "rate", f"{max(1, round(rate_bps / 1000))}kbit", "burst", str(burst), "limit", str(limit)]
        pre = [*self.exec_prefix(ns), self._tc, "qdisc", "add", "dev", dev]
        if self.latency_emulated and latency_ms > 0:
            self._must([*pre, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms"])
            self._must([*pre, "parent", "1:1", "handle", "10:", *tbf])
        else:
            self._must([*pre, "root", *tbf])

    def sent_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each SuperNode's shaped link carried so far: ``{i: {"down": n, "up": n}}``."""
        import re

        out: dict[int, dict[str, int]] = {}
        for i in range(len(self.links)):
            out[i] = {}
            for key, ns, dev in (
                ("down", self.link_ns, f"{self.name}a{i}"),
                ("up", self.node_ns(i), f"{self.name}b{i}"),
            ):
                res = _run([*self.exec_prefix(ns), self._tc, "-s", "qdisc", "show", "dev", dev])
                sent = [int(x) for x in re.findall(r"Sent (\d+) bytes", res.stdout)]
                out[i][key] = max(sent, default=0)  # netem + tbf: both count the same bytes
        return out

    def teardown(self) -> list[str]:
        """Delete every namespace this lab created (their veths go with them); return leftovers."""
        left = []
        for ns in reversed(self.created):
            out = _run([getattr(self, "_ip", "ip"), "netns", "del", ns])
            if out.returncode != 0 and "No such file" not in out.stderr:
                left.append(ns)
        self.created = left
        return left

    def __enter__(self) -> NetnsLab:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()
