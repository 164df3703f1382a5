#!/bin/sh
# Installs what the benchmarks compare against (Debian 12, as root). Safe to re-run.
#   wrk, nginx (the upstream), squid, tinyproxy, socat: Debian packages.
#   HTTP/2 (bench_h2.py): h2load (nghttp2-client), nghttpx (nghttp2-proxy), haproxy; nginx is
#   the h2c origin too (its plain `http2` listener).
#   proxy.py: from PyPI into the current Python.
#   mitmproxy: `pip install mitmproxy` fails on Python 3.11 here (pip picks a zstandard sdist and
#   cannot build it), and `--only-binary=:all:` fails too (pyperclip has no wheel), so it goes into
#   its own venv with wheels required for the compiled dependencies only.
set -eu
MITM_VENV="${MITM_VENV:-/tmp/mitm-venv}"
apt-get install -y wrk nginx squid tinyproxy socat nghttp2-client nghttp2-proxy haproxy
python3 -m pip install proxy.py
if [ ! -x "$MITM_VENV/bin/mitmdump" ]; then
    python3 -m venv "$MITM_VENV"
    "$MITM_VENV/bin/pip" install \
        --only-binary=zstandard,brotli,cryptography,aioquic,mitmproxy_rs,msgpack mitmproxy
fi
"$MITM_VENV/bin/mitmdump" --version | head -1
