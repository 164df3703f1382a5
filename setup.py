"""Only for the C extensions: everything else is in pyproject.toml.

`pip install .` compiles native/ with cffi (out-of-line API mode). Without a C compiler the
install fails loudly here; a source checkout without the extension still runs on the Python
reference implementations and says so at start (see native/README.md).
"""

from setuptools import setup

setup(
    cffi_modules=[
        "native/_build_headscan.py:ffibuilder",
        "native/_build_scrub.py:ffibuilder",
    ],
    # cffi compiles its modules against the stable ABI (Py_LIMITED_API, `.abi3.so`), so one
    # wheel serves every CPython from 3.11 on: tagged cp311-abi3 rather than cp311-cp311
    # (`make wheel-check` installs it under 3.11, 3.12 and 3.13).
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
