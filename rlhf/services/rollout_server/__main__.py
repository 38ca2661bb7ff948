"""python -m rlhf.services.rollout_server: a rollout server process (see server.py)."""

import sys

from rlhf.services.rollout_server.server import main

sys.exit(main())
