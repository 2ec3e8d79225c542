"""``python -m agentrt_cli``: the ``agentrt`` command."""

import sys

from agentrt_cli import main

sys.exit(main())
