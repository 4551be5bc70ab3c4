"""Certificates made in the test, for a TLS redis-server on loopback: a CA, a server certificate it
signs, a client certificate it signs, and a second CA that signed nothing the server shows."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          names: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_pki(folder: Path, server_names: list[str]) -> Pki:
    """Files in `folder`; the server certificate names `server_names` (host names or IP addresses)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("celery-autotune test CA")
    alternative: list[x509.GeneralName] = []
    for name in server_names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    server_key, server_cert = _leaf(ca_key, ca_cert, server_names[0], alternative, ExtendedKeyUsageOID.SERVER_AUTH)
    client_key, client_cert = _leaf(ca_key, ca_cert, "autotune-worker", [], ExtendedKeyUsageOID.CLIENT_AUTH)
    _, other_cert = _ca("some other CA")
    return Pki(ca=_write_cert(ca_cert, folder / "ca.crt"),
               server_cert=_write_cert(server_cert, folder / "redis.crt"),
               server_key=_write_key(server_key, folder / "redis.key"),
               client_cert=_write_cert(client_cert, folder / "client.crt"),
               client_key=_write_key(client_key, folder / "client.key"),
               other_ca=_write_cert(other_cert, folder / "other-ca.crt"))
