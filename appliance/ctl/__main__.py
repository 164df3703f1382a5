"""`python -m appliance.ctl ARGS`: appliancectl, the same entry point as bin/appliancectl."""

import sys

from appliance.ctl.fast import main

sys.exit(main())
