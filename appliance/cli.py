"""`python -m appliance.cli ARGS`: appliancectl's full command line (appliance/ctl/main.py),
kept under this name for the scripts and unit files that start it so."""

import sys

from appliance.ctl.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
