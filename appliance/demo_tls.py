"""The demo's throw-away certificate authority, on `cryptography` (a runtime dependency).

The tour's fake provider serves real TLS, and the proxy verifies it against a CA that exists
for the length of the tour: a CA made in memory the way a crew's is (appliance/crew_ca.py) and
one leaf for the provider's name, both valid for a day. Only the CA certificate is written out
(the proxy's `ca_file`); the keys never touch the disk (the server's context loads them from a
0600 file in the demo's private work directory, removed with it).

The tests use trustme for the same purpose; `make demo` installs no development dependency.
"""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

from appliance.crew_ca import new_ca

VALIDITY = datetime.timedelta(days=1)


def server_context(host: str, workdir: Path) -> tuple[ssl.SSLContext, Path]:
    """A server context presenting a certificate for `host`, and the path of the CA that
    signed it (PEM), both under `workdir`."""
    ca = new_ca("demo", lifetime=VALIDITY, common_name="agent-appliance demo CA")
    leaf = ca.mint(host, lifetime=VALIDITY)
    ca_path = workdir / "demo-ca.pem"
    ca_path.write_bytes(ca.cert_pem)
    chain = workdir / "demo-server.pem"
    chain.touch(mode=0o600)
    chain.write_bytes(leaf.key_pem + leaf.cert_pem)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(chain)
    return context, ca_path
