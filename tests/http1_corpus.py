"""A request-smuggling and conformance corpus for HTTP/1.1 front ends (our own generator).

Two families, each case a request followed by nothing (the test pipelines a canary behind it):

- `smuggling_cases`: about 1,700 Transfer-Encoding / Content-Length variants in the manner of the
  public smuggling scanners (header-name and value mutations, a sweep of every control and
  non-ASCII byte before and after the name, the colon and the value, quoting, duplicated and
  comma-joined fields, obs-fold, bare CR and LF, underscore and hyphen confusions, HTTP/1.0),
  each laid out as CL.TE (a Content-Length reader forwards what a chunked reader ends early), as
  TE.CL (a chunked body whose first bytes a Content-Length reader takes, leaving a request
  behind), and, for the named ones, TE alone.
- `conformance_cases`: request conformance cases in the manner of an HTTP parser's test suite
  (methods, targets, header syntax, Connection, Content-Length, chunked bodies with extensions
  and trailers, pipelining, truncation, invalid start lines).

Every request line targets the forward route to `plain.test:<port>` (or, where a case is about
something else, a host the crew may not reach, or an origin-form path), and every target holds
`TAG`, a fixed-width placeholder the test replaces with the case's number, so that what reaches
the upstream can be told apart by case while Content-Length values stay right.
"""

from __future__ import annotations

from dataclasses import dataclass

TAG = b"@@@@@@"  # replaced by "%06d" % index: same length, so every Content-Length holds


@dataclass(frozen=True)
class Case:
    name: str
    wire: bytes

    def tagged(self, index: int) -> bytes:
        return self.wire.replace(TAG, b"%06d" % index)


def _target(port: int, what: bytes) -> bytes:
    return b"http://plain.test:%d/%s/%s" % (port, TAG, what)


def _request(
    port: int, fields: bytes, body: bytes = b"", *, method: bytes = b"POST", version: bytes = b"1.1"
) -> bytes:
    head = b"%s %s HTTP/%s\r\nHost: plain.test\r\n" % (method, _target(port, b"main"), version)
    return head + fields + b"\r\n" + body


# -- Transfer-Encoding gadgets ------------------------------------------------------------------

_TE = b"Transfer-Encoding"
_NAMED_TE: list[tuple[str, bytes]] = [
    ("plain", b"Transfer-Encoding: chunked"),
    ("lower", b"transfer-encoding: chunked"),
    ("upper", b"TRANSFER-ENCODING: CHUNKED"),
    ("mixed", b"TrAnSfEr-EnCoDiNg: cHuNkEd"),
    ("no-ows", b"Transfer-Encoding:chunked"),
    ("two-sp", b"Transfer-Encoding:  chunked"),
    ("tab-value", b"Transfer-Encoding:\tchunked"),
    ("tab-both", b"Transfer-Encoding\t:\tchunked"),
    ("sp-colon", b"Transfer-Encoding : chunked"),
    ("sp-name", b" Transfer-Encoding: chunked"),
    ("tab-name", b"\tTransfer-Encoding: chunked"),
    ("space-join", b"Transfer Encoding: chunked"),
    ("space-join-smashed", b"Transfer Encoding:chunked"),
    ("underscore", b"Transfer_Encoding: chunked"),
    ("underscore-upper", b"TRANSFER_ENCODING: chunked"),
    ("underscore-and-real", b"Transfer_Encoding: cow\r\nTransfer-Encoding: chunked"),
    ("real-and-underscore", b"Transfer-Encoding: chunked\r\nTransfer_Encoding: cow"),
    ("trailing-underscore", b"Transfer-Encoding_: chunked"),
    ("double-hyphen", b"Transfer--Encoding: chunked"),
    ("no-hyphen", b"TransferEncoding: chunked"),
    ("trailing-hyphen", b"Transfer-Encoding-: chunked"),
    ("plural", b"Transfer-Encodings: chunked"),
    ("x-prefix", b"X-Transfer-Encoding: chunked"),
    ("content-encoding", b"Content-Encoding: chunked"),
    ("te-short", b"TE: chunked"),
    ("quoted", b'Transfer-Encoding: "chunked"'),
    ("aposed", b"Transfer-Encoding: 'chunked'"),
    ("lazy", b"Transfer-Encoding: chunk"),
    ("chunked-x", b"Transfer-Encoding: chunkedx"),
    ("x-chunked", b"Transfer-Encoding: xchunked"),
    ("comma-cow", b"Transfer-Encoding: chunked, cow"),
    ("cow-comma", b"Transfer-Encoding: cow, chunked"),
    ("chunked-twice", b"Transfer-Encoding: chunked, chunked"),
    ("identity-chunked", b"Transfer-Encoding: identity, chunked"),
    ("chunked-identity", b"Transfer-Encoding: chunked, identity"),
    ("gzip-chunked", b"Transfer-Encoding: gzip, chunked"),
    ("leading-comma", b"Transfer-Encoding: , chunked"),
    ("trailing-comma", b"Transfer-Encoding: chunked,"),
    ("param", b"Transfer-Encoding: chunked;q=1"),
    ("param-space", b"Transfer-Encoding: chunked ;"),
    ("nested", b"Transfer-Encoding: cow chunked bar"),
    ("inner-space", b"Transfer-Encoding: ch unked"),
    ("accent-value", b"Transfer-Encoding: ch\x96nked"),
    ("accent-name", b"Transf\x82r-Encoding: chunked"),
    ("nul-value", b"Transfer-Encoding: chunk\x00ed"),
    ("nul-name", b"Transfer-Encoding\x00: chunked"),
    ("empty", b"Transfer-Encoding:"),
    ("empty-sp", b"Transfer-Encoding: "),
    ("identity", b"Transfer-Encoding: identity"),
    ("cr-suffix", b"Transfer-Encoding: chunked\r"),
    ("cr-in-name", b"Transfer\r-Encoding: chunked"),
    ("lf-in-name", b"Transfer\n-Encoding: chunked"),
    ("lf-before-colon", b"Transfer-Encoding\n: chunked"),
    ("lf-after-colon", b"Transfer-Encoding:\nchunked"),
    ("fold-value", b"Transfer-Encoding:\r\n chunked"),
    ("fold-tab-value", b"Transfer-Encoding:\r\n\tchunked"),
    ("fold-after", b"Transfer-Encoding: chunked\r\n cow"),
    ("fold-lf", b"Transfer-Encoding:\n chunked"),
    ("x-cr-te", b"X: X\rTransfer-Encoding: chunked"),
    ("x-lf-te", b"X: X\nTransfer-Encoding: chunked"),
    ("x-fold-te", b"X: X\r\n Transfer-Encoding: chunked"),
    ("dual-cow-first", b"Transfer-Encoding: cow\r\nTransfer-Encoding: chunked"),
    ("dual-cow-last", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: cow"),
    ("dual-chunked", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"),
    ("dual-case", b"Transfer-Encoding: chunked\r\ntransfer-encoding: identity"),
    ("dual-empty", b"Transfer-Encoding:\r\nTransfer-Encoding: chunked"),
    ("vt-value", b"Transfer-Encoding:\x0bchunked"),
    ("ff-value", b"Transfer-Encoding:\x0cchunked"),
    ("nbsp-value", b"Transfer-Encoding:\xa0chunked"),
    ("nel-value", b"Transfer-Encoding:\x85chunked"),
    ("ff-byte-value", b"Transfer-Encoding:\xffchunked"),
    ("utf8-nbsp-value", b"Transfer-Encoding:\xc2\xa0chunked"),
    ("fullwidth-colon", b"Transfer-Encoding\xef\xbc\x9a chunked"),
    ("bom-name", b"\xef\xbb\xbfTransfer-Encoding: chunked"),
    ("hash-name", b"Transfer-Encoding#: chunked"),
    ("dot-name", b"Transfer.Encoding: chunked"),
]

# Every control byte and every byte outside ASCII, swept through four places of the field line
# (the scanners' "prespace", "postspace", "midspace" and "endspace").
_SWEEP_BYTES = [*range(0x00, 0x21), *range(0x7F, 0x100)]
_SWEEP_PLACES = {
    "before-name": b"%c" + _TE + b": chunked",
    "before-colon": _TE + b"%c: chunked",
    "after-colon": _TE + b":%cchunked",
    "after-value": _TE + b": chunked%c",
}


def _smuggled(port: int) -> bytes:
    """The request a Content-Length reader would find inside a chunked body (TE.CL)."""
    return b"GPOST %s HTTP/1.1\r\nHost: plain.test\r\nContent-Length: 15\r\n\r\nx=1" % _target(
        port, b"smuggled"
    )


def _cl_te(port: int, gadget: bytes, *, version: bytes = b"1.1") -> bytes:
    # A Content-Length reader forwards all of it; a chunked reader ends at "0" and leaves "G"
    # in front of the next request.
    body = b"0\r\n\r\nG"
    return _request(port, gadget + b"\r\nContent-Length: %d\r\n" % len(body), body, version=version)


def _te_cl(port: int, gadget: bytes, *, version: bytes = b"1.1") -> bytes:
    # A chunked reader forwards the whole chunk; a reader of "Content-Length: 4" takes "NN\r\n"
    # and finds a GPOST request behind it.
    inner = _smuggled(port)
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    return _request(port, gadget + b"\r\nContent-Length: 4\r\n", body, version=version)


def _te_only(port: int, gadget: bytes) -> bytes:
    # No Content-Length: whoever ignores the gadget reads no body and a bogus next request.
    return _request(port, gadget + b"\r\n", b"5\r\nhello\r\n0\r\n\r\n")


# -- Content-Length gadgets ---------------------------------------------------------------------

_NAMED_CL: list[tuple[str, bytes]] = [
    ("plain", b"Content-Length: 5"),
    ("lower", b"content-length: 5"),
    ("zero-pad", b"Content-Length: 0005"),
    ("dup-same", b"Content-Length: 5\r\nContent-Length: 5"),
    ("dup-differ", b"Content-Length: 5\r\nContent-Length: 6"),
    ("dup-differ-rev", b"Content-Length: 6\r\nContent-Length: 5"),
    ("list-same", b"Content-Length: 5, 5"),
    ("list-differ", b"Content-Length: 5, 6"),
    ("list-nospace", b"Content-Length: 5,5"),
    ("plus", b"Content-Length: +5"),
    ("minus", b"Content-Length: -5"),
    ("hex", b"Content-Length: 0x5"),
    ("float", b"Content-Length: 5.0"),
    ("exp", b"Content-Length: 5e0"),
    ("inner-space", b"Content-Length: 5 5"),
    ("no-ows", b"Content-Length:5"),
    ("sp-colon", b"Content-Length : 5"),
    ("tab-colon", b"Content-Length\t: 5"),
    ("sp-name", b" Content-Length: 5"),
    ("nul-suffix", b"Content-Length: 5\x00"),
    ("vt-prefix", b"Content-Length:\x0b5"),
    ("ff-prefix", b"Content-Length:\x0c5"),
    ("cr-suffix", b"Content-Length: 5\r"),
    ("underscore", b"Content_Length: 5"),
    ("underscore-and-real", b"Content_Length: 6\r\nContent-Length: 5"),
    ("space-join", b"Content Length: 5"),
    ("empty", b"Content-Length:"),
    ("letters", b"Content-Length: five"),
    ("arabic-indic", "Content-Length: \u0665".encode()),
    ("fullwidth", "Content-Length: \uff15".encode()),
    ("overflow-64", b"Content-Length: 18446744073709551621"),
    ("overflow-63", b"Content-Length: 9223372036854775813"),
    ("twenty-digits", b"Content-Length: 00000000000000000005"),
    ("fold", b"Content-Length: 5\r\n 6"),
    ("fold-before", b"Content-Length:\r\n 5"),
    ("lf-line", b"Content-Length: 5\nX: y"),
    ("x-cr-cl", b"X: X\rContent-Length: 6"),
    ("cl-and-te-identity", b"Content-Length: 5\r\nTransfer-Encoding: identity"),
    ("cl-and-te-empty", b"Content-Length: 5\r\nTransfer-Encoding:"),
]


def smuggling_cases(port: int) -> list[Case]:
    cases: list[Case] = []
    for name, gadget in _NAMED_TE:
        cases.append(Case(f"te/{name}/cl.te", _cl_te(port, gadget)))
        cases.append(Case(f"te/{name}/te.cl", _te_cl(port, gadget)))
        cases.append(Case(f"te/{name}/te-only", _te_only(port, gadget)))
    for name, gadget in _NAMED_TE[:24]:
        # RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 message is faulty framing.
        cases.append(Case(f"te/{name}/http1.0/cl.te", _cl_te(port, gadget, version=b"1.0")))
        cases.append(Case(f"te/{name}/http1.0/te.cl", _te_cl(port, gadget, version=b"1.0")))
    for place, template in _SWEEP_PLACES.items():
        for byte in _SWEEP_BYTES:
            gadget = template % byte
            cases.append(Case(f"te/{place}-{byte:02x}/cl.te", _cl_te(port, gadget)))
            cases.append(Case(f"te/{place}-{byte:02x}/te.cl", _te_cl(port, gadget)))
    for name, gadget in _NAMED_CL:
        # "hello" is 5 bytes: a reader of 6 eats the first byte of the next request.
        cases.append(Case(f"cl/{name}", _request(port, gadget + b"\r\n", b"hello")))
        cases.append(
            Case(f"cl/{name}/get", _request(port, gadget + b"\r\n", b"hello", method=b"GET"))
        )
        cases.append(
            Case(
                f"cl/{name}/with-te",
                _request(port, gadget + b"\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\nhello"),
            )
        )
    return cases


# -- Conformance --------------------------------------------------------------------------------


def conformance_cases(port: int) -> list[Case]:
    main = _target(port, b"main")
    host = b"Host: plain.test\r\n"

    def line(method: bytes = b"GET", target: bytes = main, version: bytes = b"HTTP/1.1") -> bytes:
        return b"%s %s %s\r\n" % (method, target, version)

    def get(fields: bytes = b"", **kw: bytes) -> bytes:
        return line(**kw) + host + fields + b"\r\n"

    def post(fields: bytes, body: bytes, **kw: bytes) -> bytes:
        return line(b"POST", **kw) + host + fields + b"\r\n" + body

    chunked = b"Transfer-Encoding: chunked\r\n"
    base = b"http://plain.test:%d/%s" % (port, TAG)
    cases = {
        # methods (RFC 9110 9, any token)
        "method/get": get(),
        "method/head": get(method=b"HEAD"),
        "method/options": get(method=b"OPTIONS"),
        "method/delete": get(method=b"DELETE"),
        "method/trace": get(method=b"TRACE"),
        "method/put": post(b"Content-Length: 3\r\n", b"abc").replace(b"POST", b"PUT", 1),
        "method/patch": post(b"Content-Length: 3\r\n", b"abc").replace(b"POST", b"PATCH", 1),
        "method/purge": get(method=b"PURGE"),
        "method/m-search": get(method=b"M-SEARCH"),
        "method/propfind": post(b"Content-Length: 2\r\n", b"<>").replace(b"POST", b"PROPFIND", 1),
        "method/lowercase": get(method=b"get"),
        "method/token-chars": get(method=b"!#$%&'*+-.^_`|~09AZ"),
        "method/invalid-char": get(method=b"G@T"),
        "method/empty": b" " + main + b" HTTP/1.1\r\n" + host + b"\r\n",
        "method/obs-text": get(method=b"G\xc9T"),
        # targets
        "uri/query": get(target=base + b"/main?a=1&b=%20x"),
        "uri/fragment": get(target=base + b"/main?q=search#hey"),
        "uri/percent": get(target=base + b"/m%C3%A9in"),
        "uri/empty-query": get(target=base + b"/main?"),
        "uri/upper-scheme": get(target=b"HTTP://plain.test:%d/%s/main" % (port, TAG)),
        "uri/upper-host": get(target=b"http://PLAIN.TEST:%d/%s/main" % (port, TAG)),
        "uri/long": get(target=base + b"/" + b"a" * 7000),
        "uri/too-long": get(target=base + b"/" + b"a" * 9000),
        "uri/space": get(target=base + b"/ma in"),
        "uri/obs-text": get(target=base + b"/m\xe9in"),
        "uri/del": get(target=base + b"/m\x7fin"),
        "uri/nul": get(target=base + b"/m\x00in"),
        "uri/tab": get(target=base + b"/m\tin"),
        "uri/denied-host": get(target=b"http://other.test:%d/%s/main" % (port, TAG)),
        "uri/origin-form": get(target=b"/%s/main" % TAG),
        "uri/asterisk": get(method=b"OPTIONS", target=b"*"),
        "uri/https": get(target=b"https://plain.test:%d/%s/main" % (port, TAG)),
        "uri/userinfo": get(target=b"http://user@plain.test:%d/%s/main" % (port, TAG)),
        # header syntax (RFC 9112 5, RFC 9110 5)
        "field/empty-value": get(b"X-Empty:\r\n"),
        "field/ows": get(b"X-Ows: \t value with  inner \t spaces \t \r\n"),
        "field/obs-text": get(b"X-Obs: caf\xc3\xa9 \xff\r\n"),
        "field/colon-in-value": get(b"X-Url: http://a:b@c/d\r\n"),
        "field/quotes": get(b'X-Q: "a, b"; c="d"\r\n'),
        "field/many": get(b"".join(b"X-F%d: %d\r\n" % (i, i) for i in range(98))),
        "field/too-many": get(b"".join(b"X-F%d: %d\r\n" % (i, i) for i in range(101))),
        "field/large": get(b"X-Big: " + b"v" * 30000 + b"\r\n"),
        "field/too-large": get(b"X-Big: " + b"v" * 33000 + b"\r\n"),
        "field/duplicate": get(b"X-Dup: 1\r\nX-Dup: 2\r\nx-dup: 3\r\n"),
        "field/no-colon": get(b"X-NoColon\r\n"),
        "field/space-in-name": get(b"X Name: 1\r\n"),
        "field/nul-value": get(b"X-Nul: a\x00b\r\n"),
        "field/del-value": get(b"X-Del: a\x7fb\r\n"),
        "field/ctl-value": get(b"X-Ctl: a\x01b\r\n"),
        "field/vt-value": get(b"X-Vt: a\x0bb\r\n"),
        "field/bare-cr": get(b"X-Cr: a\rb\r\n"),
        "field/bare-lf": get(b"X-Lf: a\nX-B: b\r\n"),
        "field/fold": get(b"X-Fold: a\r\n b\r\n"),
        "field/fold-first": line() + b" X-Fold: a\r\n" + host + b"\r\n",
        "field/empty-name": get(b": x\r\n"),
        "field/underscore": get(b"X_Under: 1\r\nX-Kept: 2\r\n"),
        "host/missing": line() + b"\r\n",
        "host/two": get(b"Host: other.test\r\n"),
        "host/empty": line() + b"Host:\r\n\r\n",
        "host/differs-from-target": line() + b"Host: other.test\r\n\r\n",
        "host/http1.0-missing": line(version=b"HTTP/1.0") + b"\r\n",
        # Connection (RFC 9112 9)
        "conn/close": get(b"Connection: close\r\n"),
        "conn/keep-alive": get(b"Connection: keep-alive\r\n"),
        "conn/list": get(b"Connection: Keep-Alive, X-Hop\r\nX-Hop: 1\r\n"),
        "conn/nominates-cl": post(b"Connection: content-length\r\nContent-Length: 3\r\n", b"abc"),
        "conn/nominates-host": get(b"Connection: host\r\n"),
        "conn/upgrade": get(b"Connection: upgrade\r\nUpgrade: websocket\r\n"),
        "conn/http1.0": get(version=b"HTTP/1.0"),
        "conn/http1.0-keep-alive": get(b"Connection: keep-alive\r\n", version=b"HTTP/1.0"),
        "conn/proxy-connection": get(b"Proxy-Connection: close\r\n"),
        "conn/close-uppercase": get(b"Connection: CLOSE\r\n"),
        # Expect (RFC 9110 10.1.1)
        "expect/continue": post(b"Expect: 100-continue\r\nContent-Length: 3\r\n", b"abc"),
        "expect/continue-1.0": post(
            b"Expect: 100-continue\r\nContent-Length: 3\r\n", b"abc", version=b"HTTP/1.0"
        ),
        "expect/other": post(b"Expect: 200-ok\r\nContent-Length: 3\r\n", b"abc"),
        # Content-Length (RFC 9112 6.2)
        "cl/zero": post(b"Content-Length: 0\r\n", b""),
        "cl/body": post(b"Content-Length: 11\r\n", b"hello world"),
        "cl/get-with-body": get(b"Content-Length: 3\r\n") + b"abc",
        "cl/leading-zeros": post(b"Content-Length: 003\r\n", b"abc"),
        "cl/short-body": post(b"Content-Length: 10\r\n", b"abc"),
        "cl/large-declared": post(b"Content-Length: 99999999\r\n", b"abc"),
        "cl/binary-body": post(b"Content-Length: 6\r\n", b"\x00\r\n\r\n\xff"),
        "cl/request-in-body": post(
            b"Content-Length: 48\r\n", b"GET /x HTTP/1.1\r\nHost: plain.test\r\n\r\n0123456789"
        ),
        # chunked (RFC 9112 7.1)
        "chunked/lower-hex": post(chunked, b"a\r\n0123456789\r\n0\r\n\r\n"),
        "chunked/upper-hex": post(chunked, b"A\r\n0123456789\r\n0\r\n\r\n"),
        "chunked/two-chunks-000": post(chunked, b"5\r\nhello\r\n6\r\n world\r\n000\r\n\r\n"),
        "chunked/zero-padded-size": post(chunked, b"0005\r\nhello\r\n0\r\n\r\n"),
        "chunked/16-digit-size": post(chunked, b"0000000000000005\r\nhello\r\n0\r\n\r\n"),
        "chunked/17-digit-size": post(chunked, b"00000000000000005\r\nhello\r\n0\r\n\r\n"),
        "chunked/overflow": post(chunked, b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n"),
        "chunked/trailers": post(
            chunked,
            b"5\r\nhello\r\n6\r\n world\r\n0\r\nVary: *\r\nContent-Type: text/plain\r\n\r\n",
        ),
        "chunked/trailer-cl": post(chunked, b"5\r\nhello\r\n0\r\nContent-Length: 50\r\n\r\n"),
        "chunked/trailer-te": post(
            chunked, b"5\r\nhello\r\n0\r\nTransfer-Encoding: chunked\r\n\r\n"
        ),
        "chunked/trailer-fold": post(chunked, b"0\r\nX: a\r\n b\r\n\r\n"),
        "chunked/trailer-bare-lf": post(chunked, b"0\r\nX: a\n\r\n"),
        "chunked/ext": post(
            chunked,
            b"5;ilovew3;somuchlove=aretheseparametersfor;another=withvalue\r\nhello\r\n"
            b"6;blahblah;blah\r\n world\r\n0\r\n\r\n",
        ),
        "chunked/ext-quoted": post(
            chunked,
            b'5;ilovew3="I \\"love\\"; \\\\extensions\\\\";somuchlove="aretheseparametersfor";'
            b"blah;foo=bar\r\nhello\r\n6;blahblah;blah\r\n world\r\n0\r\n\r\n",
        ),
        "chunked/ext-unbalanced-quote": post(
            chunked, b'5;ilovew3="abc";somuchlove="def; ghi\r\nhello\r\n0\r\n\r\n'
        ),
        "chunked/ext-no-semicolon": post(chunked, b"2 erfrferferf\r\naa\r\n0 rrrr\r\n\r\n"),
        "chunked/ext-empty": post(chunked, b"2;\r\naa\r\n0\r\n\r\n"),
        "chunked/ext-bws": post(chunked, b"2; a = b ;c\r\naa\r\n0\r\n\r\n"),
        "chunked/ext-cr": post(chunked, b"2;a\rb\r\naa\r\n0\r\n\r\n"),
        "chunked/ext-lf": post(chunked, b"2;a\nb\r\naa\r\n0\r\n\r\n"),
        "chunked/size-space": post(chunked, b"2 \r\naa\r\n0\r\n\r\n"),
        "chunked/size-lf": post(chunked, b"2\naa\r\n0\r\n\r\n"),
        "chunked/data-lf": post(chunked, b"2\r\naa\n0\r\n\r\n"),
        "chunked/data-xx": post(chunked, b"2\r\naaXX0\r\n\r\n"),
        "chunked/data-long": post(chunked, b"2\r\naaa\r\n0\r\n\r\n"),
        "chunked/end-lf": post(chunked, b"2\r\naa\r\n0\r\n\n"),
        "chunked/truncated": post(chunked, b"5\r\nhel"),
        "chunked/no-last-chunk": post(chunked, b"5\r\nhello\r\n"),
        "chunked/te-pigeons": post(b"Transfer-Encoding: pigeons\r\n", b""),
        "chunked/te-empty-cl": post(b"Transfer-Encoding:\r\nContent-Length: 5\r\n", b"hello"),
        "chunked/te-identity-cl": post(
            b"Transfer-Encoding: identity\r\nContent-Length: 5\r\n", b"World"
        ),
        "chunked/http1.0": post(chunked, b"5\r\nhello\r\n0\r\n\r\n", version=b"HTTP/1.0"),
        # start line (RFC 9112 3)
        "line/http1.0": get(version=b"HTTP/1.0"),
        "line/http1.2": get(version=b"HTTP/1.2"),
        "line/http2.0": get(version=b"HTTP/2.0"),
        "line/http0.9": b"GET " + main + b"\r\n",
        "line/lowercase-version": get(version=b"http/1.1"),
        "line/double-space": b"GET  " + main + b" HTTP/1.1\r\n" + host + b"\r\n",
        "line/tab": b"GET\t" + main + b"\tHTTP/1.1\r\n" + host + b"\r\n",
        "line/trailing-space": b"GET " + main + b" HTTP/1.1 \r\n" + host + b"\r\n",
        "line/bare-lf": b"GET " + main + b" HTTP/1.1\n" + b"Host: plain.test\n\n",
        "line/bare-cr": b"GET " + main + b" HTTP/1.1\r" + host + b"\r\n",
        "line/tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        "line/empty": b"\r\n",
        # RFC 9112 2.2: empty lines before the request line
        "empty-lines/one": b"\r\n" + get(),
        "empty-lines/four": b"\r\n" * 4 + get(),
        "empty-lines/five": b"\r\n" * 5 + get(),
        "empty-lines/lf": b"\n" + get(),
        "empty-lines/after-body": post(b"Content-Length: 2\r\n", b"hi\r\n"),
        # pipelining
        "pipeline/two-gets": get() + get(target=base + b"/second"),
        "pipeline/post-get": post(b"Content-Length: 3\r\n", b"abc") + get(target=base + b"/2"),
        "pipeline/chunked-get": post(chunked, b"3\r\nabc\r\n0\r\n\r\n") + get(target=base + b"/2"),
        "pipeline/three": get() + get(target=base + b"/2") + get(target=base + b"/3"),
        "pipeline/close-then-get": get(b"Connection: close\r\n") + get(target=base + b"/2"),
        # truncation (the test half-closes after sending)
        "finish/head": line() + host,
        "finish/line": b"GET " + main,
    }
    return [Case(f"conformance/{name}", wire) for name, wire in cases.items()]
