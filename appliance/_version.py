"""The appliance's version: the one place it is written.

The package's metadata takes it from here when it is built (pyproject.toml,
`[tool.setuptools.dynamic]`), `appliancectl --version` and `applianced --version` print it, and
an artifact built from this tree carries it. This module assigns one string literal and imports
nothing, so setuptools reads it without importing the package, and the CLI reads it without the
package metadata (which a stale development install or a frozen executable may not have right).

Semantic Versioning 2.0.0, written the PEP 440 way (`1.2.0rc1`, not `1.2.0-rc.1`): CHANGELOG.md,
"Versions", says what bumps which part.
"""

__version__ = "0.1.0"
