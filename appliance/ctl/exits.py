"""appliancectl's exit codes: one table, for every command and for applianced's HTTP statuses.

docs/cli.md prints the same table (tests/test_ctl_docs.py holds them equal). `run` exits with
the crew process's own code instead (128 + N when a signal N ended it), except for the codes of
the run itself: 124 (its --timeout), and the ones below for what went wrong before it ran.

This module imports nothing: the `run` fast path (fast.py) reads it too.
"""

OK = 0
FAILURE = 1
USAGE = 2
NOT_FOUND = 3
CONFLICT = 4
UNREACHABLE = 5
TAMPERED = 6
NOT_IN_EFFECT = 7
UNAVAILABLE = 8
DEGRADED = 9
TIMED_OUT = 124
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of our output went away (`... | head`)

# (code, name, when): the documented table.
TABLE = (
    (OK, "ok", "success; `status`: every part is up"),
    (FAILURE, "failure", "a step failed (the message says which); applianced answered 500"),
    (USAGE, "usage", "bad arguments, a bad configuration or request (the message names it); 400"),
    (NOT_FOUND, "not found", "no such crew, credential or endpoint; 404"),
    (CONFLICT, "conflict", "it exists already, or is not in a phase that allows this; 409"),
    (UNREACHABLE, "unreachable", "applianced is not answering on its admin socket"),
    (TAMPERED, "tampered", "the journal or a credential record does not verify"),
    (NOT_IN_EFFECT, "not in effect", "a change stored, not confirmed by the running proxy; 502"),
    (UNAVAILABLE, "unavailable", "the engine, a runtime or the proxy is not available; 503"),
    (DEGRADED, "degraded", "`status`: a part is down (the output names it)"),
    (TIMED_OUT, "timed out", "`run --timeout`: the command was killed"),
    (INTERRUPTED, "interrupted", "Ctrl-C (SIGINT) ended appliancectl"),
    (BROKEN_PIPE, "broken pipe", "the reader of the output went away"),
)

# applianced's HTTP statuses (appliance/daemon/errors.py: each error class carries one).
HTTP_STATUS = {
    400: USAGE,
    404: NOT_FOUND,
    405: USAGE,
    409: CONFLICT,
    413: USAGE,
    500: FAILURE,
    502: NOT_IN_EFFECT,
    503: UNAVAILABLE,
}


def for_status(status: int) -> int:
    """The exit code for an HTTP status of applianced's."""
    code = HTTP_STATUS.get(status)
    if code is not None:
        return code
    return USAGE if 400 <= status < 500 else FAILURE


def for_process(code: int) -> int:
    """A crew process's exit status as appliancectl's: 0-255, a negative one (-N: killed by
    signal N, as subprocess reports it) as 128 + N."""
    if code < 0:
        code = 128 - code
    return code if 0 <= code <= 255 else FAILURE
