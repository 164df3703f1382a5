"""The script PyInstaller freezes (packaging/agent-appliance.spec): appliance/entry.py's main."""

import sys

from appliance.entry import main

sys.exit(main())
