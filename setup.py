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
    ]
)
