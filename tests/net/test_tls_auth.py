"""Deployments over TLS with authenticated SuperNodes (issue #14 item 6).

Fast: the throwaway certificates (:mod:`fedcomp.net.tls`) are what a TLS client accepts, and what
it refuses from another CA; private keys are 0600; node keys are what Flower's
``flwr supernode register`` and ``flower-supernode`` load.

Slow (real ``flower-superlink``/``flower-supernode``/``flwr`` processes on 127.0.0.1, every wait
bounded): ``python -m fedcomp.deploy local --tls --auth`` completes and stops everything; on a TLS
SuperLink with SuperNode authentication, a SuperNode whose key is not registered, one with no
key, one without TLS, and the ``flwr`` CLI without TLS are all refused, while the registered node
alone receives the run's tasks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedcomp.errors import ConfigError
from fedcomp.net.deploy import (
    DeployError,
    LocalDeployment,
    free_ports,
    node_specs,
    refusal_reason,
    run_app,
)
from fedcomp.net.superlink import alive_pids, find_marked_pids
from fedcomp.net.tls import TlsMaterial, make_node_key, make_tls_material

REPO = Path(__file__).resolve().parents[2]


# --- certificates and keys (no Flower processes) ------------------------------------------------


def _handshake(material: TlsMaterial, cafile: Path, server_hostname: str) -> str:
    """A real TLS handshake on 127.0.0.1: a server with ``material``'s certificate, a client that
    trusts ``cafile``. Returns what the server sent through the channel; raises ssl.SSLError."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(material.server_cert, material.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    port = listener.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError), listener:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"hello over tls")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client_ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
        ):
            return tls.recv(100).decode()
    finally:
        t.join(timeout=10)


def test_server_certificate_is_trusted_through_the_throwaway_ca(tmp_path: Path) -> None:
    m = make_tls_material(tmp_path / "tls", nodes=2)
    assert _handshake(m, m.ca_cert, "127.0.0.1") == "hello over tls"
    assert _handshake(m, m.ca_cert, "localhost") == "hello over tls"
    ca = x509.load_pem_x509_certificate(m.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(m.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_client_trusting_another_ca_or_name_refuses_the_server(tmp_path: Path) -> None:
    m = make_tls_material(tmp_path / "a")
    other = make_tls_material(tmp_path / "b")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _handshake(m, other.ca_cert, "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch|doesn't match"):
        _handshake(m, m.ca_cert, "server.example")  # not in the certificate's SANs


def test_private_keys_are_0600_and_node_keys_are_what_flower_loads(tmp_path: Path) -> None:
    old = os.umask(0o000)  # the modes must not depend on the caller's umask
    try:
        m = make_tls_material(tmp_path / "tls", nodes=2)
    finally:
        os.umask(old)
    for key in (m.ca_key, m.server_key, *(n.private for n in m.nodes)):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert stat.S_IMODE(m.folder.stat().st_mode) == 0o700
    # Flower's own loaders: flower-supernode --auth-supernode-private-key, flwr supernode register.
    from flwr.cli.supernode.register import try_load_public_key

    for node in m.nodes:
        private = serialization.load_ssh_private_key(node.private.read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
        public = serialization.load_ssh_public_key(node.public.read_bytes())
        assert public == private.public_key()
        assert try_load_public_key(node.public)  # PEM bytes of an approved NIST curve key
    assert m.nodes[0].public.read_bytes() != m.nodes[1].public.read_bytes()
    again = make_node_key(tmp_path, "node-0")  # overwriting an existing key keeps it 0600
    assert stat.S_IMODE(again.private.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": -1}, "nodes must be an integer >= 0"),
        ({"hosts": ()}, "at least one name"),
        ({"hosts": ("127.0.0.1", "bad host")}, "'bad host' is neither an IP address nor a DNS name"),
        ({"hosts": ("bücher.example",)}, "IDNA-encode"),
        ({"hosts": ("a..b",)}, "'a..b' is neither"),
        ({"hosts": ("-x.example",)}, "'-x.example' is neither"),
    ],
)
def test_bad_tls_requests_are_config_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_tls_material(tmp_path, **kwargs)


def test_refusal_reasons_from_flowers_supernode_log() -> None:
    log = "\x1b[91mERROR \x1b[0m:     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
    assert refusal_reason(log + "[code: 2004] Failed to activate SuperNode.") == (
        "the SuperLink refused it: its public key is not registered"
    )
    assert "no registered key" in str(refusal_reason(log + "[code: 2001] SuperNode authentication is enabled."))
    assert "plain HTTP" in str(refusal_reason(log + "Server disconnected without sending a response."))
    assert refusal_reason(log + "Giving up reconnection after 3.00 seconds and 4 tries.") is None


def test_auth_without_tls_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--auth: SuperNode authentication needs --tls"):
        LocalDeployment(REPO, node_specs(1), tmp_path / "work", auth=True)


# --- real processes -------------------------------------------------------------------------------


def _scrub(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _pids_mentioning(needle: str) -> list[int]:
    """PIDs of live processes whose command line holds ``needle`` (a path unique to one run)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
    return alive_pids(found)


@pytest.mark.flower
@pytest.mark.slow  # real SuperLink + 2 SuperNodes + flwr run over TLS: ~75 s on 2 loaded cores
def test_cli_tls_auth_run_completes_and_stops_everything(tmp_path: Path) -> None:
    work = tmp_path / "work"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "fedcomp.deploy", "local", "--tls", "--auth", "--nodes", "2", "--rounds", "1",
         "--run-config", "dataset='digits' run-name='tls'", "--results-dir", str(tmp_path / "results"),
         "--work-dir", str(work), "--quiet", "--timeout", "240"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    assert "node-<i>.key/.pub; SuperNode authentication on (2 keys registered)" in out.stdout
    data = json.loads((tmp_path / "results" / "tls" / "results.json").read_text())
    assert data["status"] == "completed"
    assert data["rounds"][1]["num_clients"] == 2
    # The SuperLink served HTTPS, registered both keys, and activated exactly those two nodes.
    link_out = _scrub((work / "superlink.out").read_text())
    assert "Uvicorn running on https://127.0.0.1:" in link_out
    link_log = _scrub((work / "superlink.log").read_text())
    registered = sorted(
        line.rsplit("node_id=", 1)[1].strip() for line in link_log.splitlines() if "RegisterNode] Created" in line
    )
    activated = sorted(
        line.rsplit("node_id=", 1)[1].strip() for line in link_log.splitlines() if "ActivateNode] Activated" in line
    )
    assert len(registered) == 2 and activated == registered
    assert sorted(str(i) for i in data["rounds"][1]["clients"]["ids"]) == registered
    for i in range(2):  # each SuperNode was started with its own key and the CA
        node_log = _scrub((work / f"node-{i}" / "supernode.log").read_text())
        assert "Starting insecure channel" not in node_log
    for key in ("ca.key", "server.key", "node-0.key", "node-1.key"):
        assert stat.S_IMODE((work / "tls" / key).stat().st_mode) == 0o600
    assert _pids_mentioning(str(work)) == []  # SuperLink, SuperNodes, SuperExecs: all gone
    print(f"TLS + auth deployment: 2 SuperNodes, 1 round, {elapsed:.1f}s")


@pytest.fixture(scope="module")
def tls_auth_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """A TLS SuperLink with SuperNode authentication and one registered, online SuperNode."""
    work = tmp_path_factory.mktemp("tls-auth")
    material = make_tls_material(work / "tls", nodes=1)
    dep = LocalDeployment(REPO, node_specs(1), work / "deploy", tls=material, auth=True, node_max_wait_s=30)
    try:
        dep.start(timeout_s=120)
        yield dep
    finally:
        pids = dep.stop()
        assert alive_pids(pids) == [] and find_marked_pids(dep.token) == []


def _wait_refused(dep: LocalDeployment, procs: dict[str, subprocess.Popen], timeout_s: float) -> dict[str, str]:
    """Each rogue SuperNode's log once it exited, or was refused and had 5 s to exit (all bounded
    by ``timeout_s``)."""
    logs: dict[str, str] = {}
    marked: dict[str, float] = {}  # when Flower's "Exit Code:" line appeared
    deadline = time.monotonic() + timeout_s
    while len(logs) < len(procs) and time.monotonic() < deadline:
        for name, proc in procs.items():
            if name in logs:
                continue
            text = _scrub((dep.work_dir / name / "supernode.log").read_text(errors="replace"))
            if "Exit Code:" in text:
                marked.setdefault(name, time.monotonic())
            if proc.poll() is not None or time.monotonic() - marked.get(name, math.inf) > 15:
                logs[name] = text
        time.sleep(0.5)
    return logs


@pytest.mark.flower
@pytest.mark.slow  # real SuperLink + 5 SuperNodes + flwr run over TLS: ~90 s on 2 loaded cores
def test_unregistered_keyless_and_insecure_clients_are_refused(tls_auth_deployment: LocalDeployment) -> None:
    dep = tls_auth_deployment
    assert dep.tls is not None and len(dep.registered) == 1
    (good,) = dep.registered.values()
    assert dep.online_nodes() == [str(good)]

    stranger = make_node_key(dep.work_dir, "stranger")  # a valid key pair nobody registered
    other_ca = make_tls_material(dep.work_dir / "other-ca").ca_cert
    ports = free_ports(4)
    # The unregistered node through this project's own CLI (`deploy supernode --auth-key`).
    (dep.work_dir / "unregistered").mkdir()
    with open(dep.work_dir / "unregistered" / "supernode.log", "w") as log:
        cli = subprocess.Popen(
            [sys.executable, "-m", "fedcomp.deploy", "supernode", "--superlink", f"127.0.0.1:{dep.port}",
             "--root-certificates", str(dep.tls.ca_cert), "--auth-key", str(stranger.private),
             "--max-wait-time", "5", "--port", str(ports[0]), "--partition-id", "0", "--num-partitions", "1",
             "--uplink-mbps", "10", "--downlink-mbps", "10"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
            env={**os.environ, "FLWR_HOME": str(dep.work_dir / "unregistered")},
        )  # fmt: skip
    rogues = {
        "unregistered": cli,
        "keyless": dep.spawn_supernode("keyless", ports[1], max_wait_s=5),
        "insecure": dep.spawn_supernode("insecure", ports[2], insecure=True, max_wait_s=5),
        "other-ca": dep.spawn_supernode("other-ca", ports[3], root_certificates=other_ca, max_wait_s=5),
    }
    t0 = time.monotonic()
    try:
        logs = _wait_refused(dep, rogues, timeout_s=90)
        print(f"rogues refused after {time.monotonic() - t0:.1f}s")
        online = dep.online_nodes()
    finally:
        stopped = [pid for proc in rogues.values() for pid in dep.stop_session(proc)]
    assert alive_pids(stopped) == []
    assert set(logs) == set(rogues), f"not refused within 90 s: {set(rogues) - set(logs)}"
    assert "[code: 2004] Failed to activate SuperNode." in logs["unregistered"]
    assert refusal_reason(logs["unregistered"]) == "the SuperLink refused it: its public key is not registered"
    assert cli.returncode == 1, logs["unregistered"][-2000:]
    assert (
        "FAILED: this SuperNode was not admitted (the SuperLink refused it: its public key is not registered"
        in (logs["unregistered"])
    )
    assert "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered" in logs["keyless"]
    # A plaintext client against the TLS port: gRPC reports the server hanging up on it, or, when
    # the attempt is cut short first (seen once on a loaded CI machine), only its failed attempts.
    assert any(
        text in logs["insecure"]
        for text in ("Server disconnected without sending a response", "Connection attempt failed")
    ), logs["insecure"][-2000:]
    assert "CERTIFICATE_VERIFY_FAILED" in logs["other-ca"]  # it does not trust this SuperLink either
    for text in logs.values():
        assert "Failed to initialize the connection to the SuperLink" in text
        assert "SuperNode ID:" not in text  # never activated, so never handed a task
    # The SuperLink's side: why it refused the two that spoke TLS.
    link_log = _scrub((dep.work_dir / "superlink.log").read_text())
    assert "ApiError:2004" in link_log and "No SuperNode found with the given public key" in link_log
    assert "ApiError:2001" in link_log
    assert online == [str(good)]

    # The flwr CLI without TLS cannot talk to the SuperLink either: it exits non-zero, naming it
    # (not "did not finish within 60s": refused, not hanging).
    with pytest.raises(DeployError, match="could not be reached"):
        run_app(REPO, f"127.0.0.1:{dep.port}", {}, flwr_home=dep.work_dir / "insecure-cli", timeout_s=60, insecure=True)

    # ... while the app over TLS runs to completion on the registered node alone.
    results = dep.work_dir / "results"
    data = dep.run(
        {"dataset": "digits", "num-server-rounds": 1, "results-dir": str(results), "run-name": "auth"}, timeout_s=180
    )
    assert data["status"] == "completed"
    assert data["rounds"][1]["clients"]["ids"] == [str(good)]


def test_certs_command_makes_material_for_named_hosts_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedcomp.deploy import main as deploy_main

    out = tmp_path / "pki"
    assert deploy_main(["certs", "--out", str(out), "--nodes", "2", "--host", "server.example"]) == 0
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["server.example"]
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.key", "ca.pem", "node-0.key", "node-0.pub", "node-1.key", "node-1.pub", "server.key", "server.pem",
    ]  # fmt: skip
    before = (out / "node-0.key").read_bytes()
    assert deploy_main(["certs", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (out / "node-0.key").read_bytes() == before
