"""appliancectl, the operator's command line: one module per noun, and the admin client.

    fast.py      the entry point (bin/appliancectl, `python -m appliance.ctl`): `run` on a
                 start-up budget, every other command line to main.py
    main.py      the argparse tree, global options, dispatch, exit codes for what escapes
    output.py    -o table|wide|json|yaml|name: data on stdout, errors on stderr
    context.py   the admin socket and config a command talks to
    exits.py     the one table of exit codes (docs/cli.md)
    client.py    the typed admin client (msgspec messages), also used by the tests
    http.py, session.py, tinyjson.py   its transport, shared with the `run` fast path
    crew, cred, journal, events, status, doctor, net, run, proxy, completion: the nouns

This package imports nothing on import (fast.py's start-up budget).
"""
