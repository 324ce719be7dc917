"""Throwaway TLS material for a local deployment: a CA, a server certificate, SuperNode keys.

``python -m fedcomp.deploy local --tls [--auth]`` makes these in a folder of the run
(``<work-dir>/tls``) and never reuses them::

    ca.pem                  the CA certificate (self-signed): the SuperNodes' and the CLI's
                            --root-certificates / root-certificates
    ca.key                  the CA's private key (0600; only needed to sign more certificates)
    server.pem, server.key  the SuperLink's certificate (SANs: 127.0.0.1, ::1, localhost), its key (0600)
    node-<i>.key            SuperNode i's authentication key, ECDSA P-384 in OpenSSH format (0600):
                            flower-supernode --auth-supernode-private-key
    node-<i>.pub            its public key, OpenSSH format: flwr supernode register node-<i>.pub

Why these formats: Flower 1.41's SuperLink serves TLS from PEM files (``--ssl-ca-certfile``,
``--ssl-certfile``, ``--ssl-keyfile``); ``flwr supernode register`` accepts only an OpenSSH public
key on a NIST curve, and ``flower-supernode`` loads its private key with
``load_ssh_private_key`` (the files ``ssh-keygen -t ecdsa -b 384 -N ""`` writes, as Flower's own
authentication example does). Private keys are created with mode 0600 (never group- or
world-readable, not even for an instant) and are not encrypted: they are for one run on one machine.
For a real deployment across hosts use a CA you manage; this module is for the loopback drill.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509  # a flwr dependency
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedcomp.errors import ConfigError

__all__ = [
    "DEFAULT_HOSTS",
    "NodeKey",
    "TlsMaterial",
    "make_node_key",
    "make_tls_material",
    "write_private",
]

#: Names the server certificate is valid for: the loopback deployment's addresses.
DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "::1", "localhost")
#: A DNS name as a certificate may hold it: ASCII labels (LDH), an optional leading wildcard label.
_DNS_NAME = re.compile(r"(\*\.)?(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")
#: Lifetime of the throwaway certificates (a local run lasts minutes; a day leaves room for clock skew).
VALID_FOR = datetime.timedelta(days=1)


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode's authentication key pair (OpenSSH files)."""

    private: Path
    public: Path


@dataclass(frozen=True)
class TlsMaterial:
    """Paths of the files :func:`make_tls_material` wrote."""

    folder: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    nodes: tuple[NodeKey, ...]

    def superlink_args(self) -> list[str]:
        """``flower-superlink`` options that turn TLS on for its one HTTP port."""
        return [
            "--ssl-ca-certfile", str(self.ca_cert),
            "--ssl-certfile", str(self.server_cert),
            "--ssl-keyfile", str(self.server_key),
        ]  # fmt: skip


#: A CA that signs certificates (and CRLs), nothing else.
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file created with mode 0600 (an existing file is replaced)."""
    path.unlink(missing_ok=True)  # O_CREAT's mode only applies to a file it creates
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # whatever the umask said


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedcomp local deployment"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if len(host) > 253 or not _DNS_NAME.fullmatch(host):
                raise ConfigError(
                    f"tls hosts: {host!r} is neither an IP address nor a DNS name (ASCII labels of letters, digits "
                    "and '-'; IDNA-encode others)"
                ) from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_node_key(folder: Path, name: str) -> NodeKey:
    """A SuperNode authentication key pair: ``<name>.key`` (0600) and ``<name>.pub``, ECDSA P-384.

    P-384 because ``flwr supernode register`` takes only NIST curves and Flower's docs use it.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = folder / f"{name}.key", folder / f"{name}.pub"
    write_private(
        priv,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + f" fedcomp-{name}\n".encode()
    )
    return NodeKey(priv, pub)


def make_tls_material(folder: str | Path, nodes: int = 0, hosts: Sequence[str] = DEFAULT_HOSTS) -> TlsMaterial:
    """Make a throwaway CA, a server certificate for ``hosts`` signed by it, and ``nodes`` key pairs.

    Everything goes into ``folder`` (created 0700 if missing). Raises :class:`ConfigError` for
    a negative node count or a host that is neither an IP address nor a DNS name.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"tls: nodes must be an integer >= 0 (got {nodes!r})")
    if not hosts:
        raise ConfigError("tls hosts: give at least one name for the server certificate")
    san = _san(hosts)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    out = out.resolve()
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + VALID_FOR

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("fedcomp throwaway CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(san, critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    material = TlsMaterial(
        folder=out,
        ca_cert=out / "ca.pem",
        ca_key=out / "ca.key",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
        nodes=tuple(make_node_key(out, f"node-{i}") for i in range(nodes)),
    )
    write_private(material.ca_key, _pem_key(ca_key))
    material.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private(material.server_key, _pem_key(server_key))
    material.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    return material
