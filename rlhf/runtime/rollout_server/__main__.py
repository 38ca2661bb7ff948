"""python -m rlhf.runtime.rollout_server: a rollout server process (see server.py)."""

import sys

from rlhf.runtime.rollout_server.server import main

sys.exit(main())
