"""The node's own certificate authority for Kafka connections (docs/security.md).

Every Kafka client checks the brokers' certificates with this CA, and the brokers' own
certificate (rlnode.bus.principals.BROKER_CERT_NAME) is the only way onto their controller
listener. `rlnode up` makes the CA once under the data directory and issues the broker's
certificate at each start; `rlnode kafka-cert` issues one for compose's brokers. Keys are
EC P-256; every file is 0600 like the node's other secrets.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rlnode.service.files import private_dir, write_private

CA_DAYS = 3650
CERT_DAYS = 825  # the longest a TLS library is expected to accept for a leaf


class CertificateError(RuntimeError):
    pass


@dataclass(frozen=True)
class Identity:
    """Where a party's certificate, its key and the CA that checks its peer lie."""

    ca: Path
    cert: Path
    key: Path

    def pem_bundle(self) -> bytes:
        """Certificate then key in one file: a Kafka broker's PEM keystore."""
        return self.cert.read_bytes() + self.key.read_bytes()


@dataclass(frozen=True)
class Issued:
    cert_pem: bytes
    key_pem: bytes


class NodeCA:
    """A CA under `directory` (ca.pem, ca.key), made on first use and kept."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.pem"
        self.key_path = directory / "ca.key"

    @classmethod
    def ensure(cls, directory: Path, name: str = "rlnode node CA") -> NodeCA:
        ca = cls(private_dir(directory))
        if not ca.cert_path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
            now = _now()
            cert = (
                x509.CertificateBuilder()
                .subject_name(subject)
                .issuer_name(subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=False,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=True,
                        crl_sign=True,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .sign(key, hashes.SHA256())
            )
            # The key first: a CA certificate without its key must never be left behind.
            write_private(ca.key_path, _key_pem(key))
            write_private(ca.cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return ca

    @property
    def cert_pem(self) -> bytes:
        return self.cert_path.read_bytes()

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        try:
            cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        except (OSError, ValueError) as e:
            raise CertificateError(
                f"cannot read the node's Kafka CA in {self.directory} ({e}): run this on the "
                "control host, as the user that runs the node"
            ) from e
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CertificateError(f"{self.key_path} is not the EC key rlnode made")
        return cert, key

    def issue(self, name: str, addresses: tuple[str, ...] = ()) -> Issued:
        """A certificate for `name` (its common name: who a client is), good for a client
        and, when `addresses` (IPs or DNS names) are given, for a server at them."""
        if not name or any(c in name for c in "\n\r\0/,=+"):
            raise CertificateError(f"certificate name {name!r}: use letters, digits, - _ . @")
        ca_cert, ca_key = self._load()
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if addresses:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_general_name(a) for a in addresses]), critical=False
            )
        cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
            ca_key, hashes.SHA256()
        )
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def write_identity(
        self, directory: Path, name: str, addresses: tuple[str, ...] = ()
    ) -> Identity:
        """Issue `name` a certificate and write it, its key and the CA (0600) to `directory`."""
        issued = self.issue(name, addresses)
        return write_identity(directory, name, issued, self.cert_pem)


def write_identity(directory: Path, name: str, issued: Issued, ca_pem: bytes) -> Identity:
    private_dir(directory)
    identity = Identity(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}.key")
    write_private(identity.key, issued.key_pem)
    write_private(identity.cert, issued.cert_pem)
    write_private(identity.ca, ca_pem)
    return identity


def common_name(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def _general_name(address: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
