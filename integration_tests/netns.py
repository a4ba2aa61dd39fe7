"""Parts of a test's stack behind a network link that the test cuts and restores: a network namespace of the
test's own, joined to the host by a veth pair on a /30 of 10.77.0.0/16 that no address here uses yet.

Cutting sets the namespace's end of the pair down. The host's end keeps its address, its route and a permanent
neighbour entry for the namespace's address, so whatever the host sends there is dropped: no TCP reset, no
"connection refused", and no "no route to host" either (which a failed ARP lookup would say within seconds). A
request on an established connection waits for an answer that never comes; a new connection's SYN goes unanswered
until the caller's own timeout. The namespace's own traffic to the host fails at once (its route went with its
link): the vanished node sends nothing. Restoring sets the link up again; TCP's retransmissions carry the
connections that are still open on.

Root only (`ip netns`, `ip link`), as CI runs the tests: `unusable()` says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prorl_adapter.dev.localstack import Service

IP = shutil.which("ip") or "/usr/sbin/ip"
PREFIX = "prorl-part-"  # namespaces made here: PREFIX + the making process's pid + a random suffix
NS_END = "vn0"  # the pair's end inside the namespace (names are per namespace)
CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)


def ip(*args: str, namespace: str | None = None) -> str:
    """Run `ip ARGS` (inside `namespace` where given); its stdout. RuntimeError with its stderr if it fails."""
    argv = [IP, "netns", "exec", namespace, IP, *args] if namespace else [IP, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def unusable() -> str | None:
    """Why this machine cannot make namespaces and links here (a reason to skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces and veth links need root (CI runs the integration tests as root)"
    if not Path(IP).exists():
        return f"{IP} (iproute2) is missing"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"`ip netns add` cannot be used here: {exc}"
    try:
        ip("link", "add", f"pp{secrets.token_hex(4)}", "type", "veth", "peer", "name", NS_END, "netns", probe)
    except (RuntimeError, OSError) as exc:
        return f"veth pairs cannot be made here: {exc}"
    finally:
        with contextlib.suppress(RuntimeError, OSError):
            ip("netns", "del", probe)  # takes the pair with it
    return None


def remove_stale_namespaces() -> None:
    """Delete the namespaces a test process that died (SIGKILL, no clean-up) left: those named with a pid that
    no longer runs. Another test run's are left alone."""
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.fullmatch(rf"{re.escape(PREFIX)}(\d+)-\w+", name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", name)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 10.77.0.0/16 that no address on this host (nor any namespace of ours) overlaps."""
    used = [
        ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
        for entry in json.loads(ip("-j", "-4", "addr", "show") or "[]")
        for a in entry.get("addr_info", [])
    ]
    space = ipaddress.ip_network("10.77.0.0/16")
    for _ in range(1000):
        index = secrets.randbelow(space.num_addresses // 4)
        subnet = ipaddress.ip_network(f"{space.network_address + 4 * index}/30")
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise RuntimeError("no free /30 in 10.77.0.0/16")


@dataclass
class Link:
    """A namespace (`namespace`) and the veth pair that joins it to the host: `host_address` on the host's end
    (`host_end`), `ns_address` on the namespace's."""

    namespace: str
    host_end: str
    host_address: str
    ns_address: str
    cut_now: bool = False

    def inside(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (`ip netns exec` execs it: the pid is the command's own)."""
        return [IP, "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Drop every packet from here on, both ways, without a word to either side."""
        ip("link", "set", NS_END, "down", namespace=self.namespace)
        self.cut_now = True

    def restore(self) -> None:
        ip("link", "set", NS_END, "up", namespace=self.namespace)
        self._pin_neighbours()  # a link set down flushes its own end's entries
        self.cut_now = False

    def _pin_neighbours(self) -> None:
        """Permanent neighbour entries both ways: nothing is resolved over the link, so nothing fails fast."""
        ns_mac = json.loads(ip("-j", "link", "show", NS_END, namespace=self.namespace))[0]["address"]
        host_mac = json.loads(ip("-j", "link", "show", self.host_end))[0]["address"]
        ip("neigh", "replace", self.ns_address, "lladdr", ns_mac, "dev", self.host_end, "nud", "permanent")
        ip("neigh", "replace", self.host_address, "lladdr", host_mac, "dev", NS_END, "nud", "permanent",
           namespace=self.namespace)  # fmt: skip

    def listening_socket(self, port: int = 0) -> socket.socket:
        """A TCP socket listening on the namespace's address, made inside the namespace (by a thread that joins
        it and ends), for a server started there with `--listen-fd`."""
        made: list[socket.socket | BaseException] = []

        def bind() -> None:
            try:
                with open(f"/run/netns/{self.namespace}") as handle:
                    if _LIBC.setns(handle.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.namespace}")
                made.append(socket.create_server((self.ns_address, port)))
            except BaseException as exc:  # handed to the caller's thread
                made.append(exc)

        thread = threading.Thread(target=bind, name=f"bind in {self.namespace}")
        thread.start()
        thread.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def remove(self) -> None:
        """Delete the pair and the namespace (what still runs in it keeps it until it ends: stop that first)."""
        with contextlib.suppress(RuntimeError):
            ip("link", "del", self.host_end)
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", self.namespace)


@contextlib.contextmanager
def link() -> Iterator[Link]:
    """A namespace joined to the host by a veth pair, both ends up; removed on exit, whatever happened."""
    remove_stale_namespaces()
    subnet = _free_subnet()
    host_address, ns_address = (str(a) for a in subnet.hosts())
    made = Link(f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}", f"pp{secrets.token_hex(5)}", host_address, ns_address)
    try:
        ip("netns", "add", made.namespace)
        ip("link", "add", made.host_end, "type", "veth", "peer", "name", NS_END, "netns", made.namespace)
        ip("addr", "add", f"{host_address}/30", "dev", made.host_end)
        ip("link", "set", made.host_end, "up")
        ip("addr", "add", f"{ns_address}/30", "dev", NS_END, namespace=made.namespace)
        ip("link", "set", NS_END, "up", namespace=made.namespace)
        ip("link", "set", "lo", "up", namespace=made.namespace)
        made._pin_neighbours()
        yield made
    finally:
        made.remove()


def start_bound(
    name: str,
    argv: list[str],
    health_path: str,
    sock: socket.socket,
    *,
    inside: Link | None = None,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> Service:
    """Start `argv` (its "{listen_fd}" standing for `sock`, which it inherits) in a session of its own, inside
    `inside`'s namespace where given, and wait until `health_path` answers 200 at the socket's address."""
    host, port = sock.getsockname()[:2]
    try:
        argv = [a.replace("{listen_fd}", str(sock.fileno())) for a in argv]
        with open(log, "wb") if log else contextlib.nullcontext() as out:
            process = subprocess.Popen(
                inside.inside(argv) if inside else argv,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                pass_fds=(sock.fileno(),),
                env={**os.environ, **env} if env else None,
            )
    finally:
        sock.close()  # the child holds its own copy
    return Service(name, f"http://{host}:{port}", process, log).wait_healthy(health_path, timeout)
