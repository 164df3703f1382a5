"""A certificate authority per crew, and the short-lived leaf certificates it signs.

Theory of operation
-------------------
To read a crew's HTTPS requests to a host (credential injection, method and path rules,
scrubbing) the proxy must terminate TLS for that host, so the crew must trust a certificate the
appliance made for it. Each crew gets its own CA: a certificate installed into the crew's trust
at create time, and a private key that stays with applianced (in its encrypted credential store),
never in the crew and never in a proxy worker.

Leaves are minted by applianced, not by the worker: the hosts a crew's TLS is terminated for are
known in advance (the hosts with a credential binding or method and path rules), so applianced
mints one leaf per such host and hands the worker the leaf's certificate and key only. A
compromised worker can then impersonate those hosts to that crew for the leaf's lifetime, and
nothing else: it cannot mint a certificate for any other name.

Choices, each the conservative one a reviewer expects:
- ECDSA P-256 keys (every TLS client verifies them; signing is fast: the cold mint figure is in
  docs/benchmarks.md), SHA-256 signatures.
- The CA: `basicConstraints CA:TRUE, pathlen:0` (it signs leaves only), `keyUsage keyCertSign,
  cRLSign`, a subject naming the crew, valid `CA_LIFETIME` (one year), re-made on rotation.
- A leaf: `basicConstraints CA:FALSE`, `keyUsage digitalSignature`, `extendedKeyUsage
  serverAuth`, the host as its only subjectAltName (DNS name, or IP address for a literal), the
  CA's key identifier, a random 159-bit serial (CA/Browser Forum baseline requirements 7.1: at
  least 64 bits of entropy), valid from one hour back (clock skew) for `LEAF_LIFETIME` (7 days;
  the public WebPKI moves toward 47 days by 2029, and a leaf here is re-minted at will).
- `LeafCache` keeps at most `CACHE_SIZE` leaves per CA and mints again once a leaf has used half
  its lifetime, so a served leaf always has days left.

Rotation: `new_ca` again, re-install the certificate in the crew (a restart of the crew's
containers), mint new leaves; the old leaves stop being trusted with the old certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CA_LIFETIME", "LEAF_LIFETIME", "CrewCA", "Leaf", "LeafCache", "new_ca"]

CA_LIFETIME = datetime.timedelta(days=365)
LEAF_LIFETIME = datetime.timedelta(days=7)
BACKDATE = datetime.timedelta(hours=1)
CACHE_SIZE = 1024
ORGANIZATION = "agent-appliance"


@dataclass(frozen=True, slots=True)
class Leaf:
    """A host's certificate and key, PEM; `not_after` for renewal."""

    host: str
    cert_pem: bytes
    key_pem: bytes
    not_before: datetime.datetime
    not_after: datetime.datetime

    def __repr__(self) -> str:  # the key stays out of logs
        return f"Leaf({self.host!r}, not_after={self.not_after.isoformat()})"


class CrewCA:
    """One crew's CA: its certificate (public) and key (kept by applianced)."""

    __slots__ = ("_key", "cert", "crew")

    def __init__(self, crew: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.crew = crew
        self.cert = cert
        self._key = key

    @classmethod
    def load(cls, crew: str, cert_pem: bytes, key_pem: bytes) -> CrewCA:
        """From what `cert_pem` and `key_pem` wrote (the key as the credential store held it)."""
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("a crew CA key must be an EC key")
        public = cert.public_key()
        if (
            not isinstance(public, ec.EllipticCurvePublicKey)
            or public.public_numbers() != key.public_key().public_numbers()
        ):
            raise ValueError("the crew CA's key does not match its certificate")
        return cls(crew, cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """The private key, PEM, unencrypted: for the encrypted credential store only."""
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def mint(
        self,
        host: str,
        *,
        now: datetime.datetime | None = None,
        lifetime: datetime.timedelta = LEAF_LIFETIME,
    ) -> Leaf:
        """A leaf for `host` (a normalized host name or an IP literal), signed by this CA."""
        now = now or datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        not_before = now - BACKDATE
        # Never past the CA's own end: a client would refuse the chain then anyway.
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = x509.DNSName(host)
        ca_ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                        x509.NameAttribute(NameOID.COMMON_NAME, host[:64]),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(secrets.randbits(159) | 1)
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([name]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(self._key, hashes.SHA256())
        )
        return Leaf(
            host,
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            not_before,
            not_after,
        )

    def __repr__(self) -> str:
        return f"CrewCA({self.crew!r}, not_after={self.cert.not_valid_after_utc.isoformat()})"


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def new_ca(
    crew: str,
    *,
    now: datetime.datetime | None = None,
    lifetime: datetime.timedelta = CA_LIFETIME,
    common_name: str | None = None,
) -> CrewCA:
    """A fresh CA for crew `crew` (`common_name`: another subject, e.g. the demo's)."""
    now = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(
                NameOID.COMMON_NAME, (common_name or f"{ORGANIZATION} crew {crew} CA")[:64]
            ),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(secrets.randbits(159) | 1)
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return CrewCA(crew, cert, key)


class LeafCache:
    """Leaves by host for one CA: minted on first use, again after half their lifetime; at most
    `size` kept (least recently used dropped)."""

    __slots__ = ("_leaves", "ca", "size")

    def __init__(self, ca: CrewCA, size: int = CACHE_SIZE) -> None:
        self.ca = ca
        self.size = size
        self._leaves: OrderedDict[str, Leaf] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leaves)

    def get(
        self,
        host: str,
        *,
        now: datetime.datetime | None = None,
        early: datetime.timedelta = datetime.timedelta(0),
    ) -> Leaf:
        """`early`: mint again that long before the half-life already (a renewal that runs
        periodically passes its period, so a leaf is renewed before its half, not after)."""
        now = now or datetime.datetime.now(datetime.UTC)
        leaf = self._leaves.get(host)
        if leaf is not None:
            half = leaf.not_before + (leaf.not_after - leaf.not_before) / 2
            if now + early < half:
                self._leaves.move_to_end(host)
                return leaf
        leaf = self.ca.mint(host, now=now)
        self._leaves[host] = leaf
        self._leaves.move_to_end(host)
        while len(self._leaves) > self.size:
            self._leaves.popitem(last=False)
        return leaf
