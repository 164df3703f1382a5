"""The crew CA (appliance/crew_ca.py): what it signs verifies for that host only, under that
crew's CA only, with real TLS clients (Python's ssl, curl, openssl); the leaf cache renews and
stays bounded; keys never show in a repr."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509 import verification

from appliance.crew_ca import LEAF_LIFETIME, CrewCA, LeafCache, new_ca

NOW = datetime.datetime(2026, 11, 26, 12, 0, tzinfo=datetime.UTC)


def _verify(ca: CrewCA, leaf_pem: bytes, host: str, now: datetime.datetime = NOW) -> None:
    leaf = x509.load_pem_x509_certificate(leaf_pem)
    name: x509.DNSName | x509.IPAddress
    try:
        name = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        name = x509.DNSName(host)
    verifier = (
        verification.PolicyBuilder()
        .store(verification.Store([ca.cert]))
        .time(now)
        .build_server_verifier(name)
    )
    verifier.verify(leaf, [])


def test_a_leaf_verifies_for_its_host_under_its_crews_ca_only() -> None:
    ca = new_ca("alpha", now=NOW)
    leaf = ca.mint("api.github.com", now=NOW)
    _verify(ca, leaf.cert_pem, "api.github.com")
    with pytest.raises(verification.VerificationError):
        _verify(ca, leaf.cert_pem, "evil.test")
    with pytest.raises(verification.VerificationError):
        _verify(new_ca("beta", now=NOW), leaf.cert_pem, "api.github.com")
    with pytest.raises(verification.VerificationError):  # expired after its lifetime
        _verify(ca, leaf.cert_pem, "api.github.com", NOW + LEAF_LIFETIME + datetime.timedelta(1))
    ip_leaf = ca.mint("10.1.2.3", now=NOW)
    _verify(ca, ip_leaf.cert_pem, "10.1.2.3")


def test_the_ca_signs_leaves_only_and_the_leaf_serves_only() -> None:
    ca = new_ca("alpha", now=NOW)
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and not usage.digital_signature
    leaf = x509.load_pem_x509_certificate(ca.mint("h.test", now=NOW).cert_pem)
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["h.test"]
    assert leaf.serial_number.bit_length() > 64
    assert leaf.not_valid_before_utc < NOW  # backdated for clock skew


def test_load_round_trip_and_a_mismatched_key_is_refused() -> None:
    ca = new_ca("alpha", now=NOW)
    again = CrewCA.load("alpha", ca.cert_pem, ca.key_pem())
    _verify(again, again.mint("x.test", now=NOW).cert_pem, "x.test", NOW)
    with pytest.raises(ValueError, match="does not match"):
        CrewCA.load("alpha", ca.cert_pem, new_ca("other").key_pem())
    leaf = ca.mint("x.test")
    assert b"PRIVATE" not in repr(ca).encode() and "PRIVATE" not in repr(leaf)


def test_the_cache_reuses_renews_at_half_life_and_stays_bounded() -> None:
    cache = LeafCache(new_ca("alpha", now=NOW), size=3)
    first = cache.get("a.test", now=NOW)
    assert cache.get("a.test", now=NOW + datetime.timedelta(days=3)) is first
    renewed = cache.get("a.test", now=NOW + datetime.timedelta(days=4))
    assert renewed is not first and renewed.not_after > first.not_after
    for host in ("b.test", "c.test", "d.test"):
        cache.get(host, now=NOW)
    assert len(cache) == 3  # a.test, the least recently used, went first
    assert cache.get("b.test", now=NOW) is cache.get("b.test", now=NOW)


@pytest.fixture
def served(tmp_path: Path):
    """A TLS server on loopback with a leaf for api.example.test; the crew CA's file."""
    ca = new_ca("alpha")
    leaf = ca.mint("api.example.test")
    (tmp_path / "leaf.pem").write_bytes(leaf.cert_pem + leaf.key_pem)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "leaf.pem")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(4096)
                    tls.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    )
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port, tmp_path / "ca.pem", tmp_path
    stop.set()
    thread.join(5)
    listener.close()


def test_real_clients_trust_the_leaf_through_the_crews_ca(served) -> None:
    port, ca_file, tmp = served
    client = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        client.wrap_socket(raw, server_hostname="api.example.test") as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        client.wrap_socket(raw, server_hostname="other.example.test")
    if shutil.which("curl"):
        done = subprocess.run(
            ["curl", "-sS", "--max-time", "10", "--cacert", str(ca_file), "--resolve",
             f"api.example.test:{port}:127.0.0.1", f"https://api.example.test:{port}/"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.stdout == "ok", done.stderr
    if shutil.which("openssl"):
        leaf = subprocess.run(
            ["openssl", "verify", "-CAfile", str(ca_file), "-purpose", "sslserver",
             str(tmp / "leaf.pem")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert leaf.returncode == 0 and leaf.stdout.strip().endswith(": OK"), leaf.stdout
