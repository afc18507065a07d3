"""`python -m moeless.expert_fn.host`: one expert host process (main.py)."""

import sys

from moeless.expert_fn.host.main import main

sys.exit(main())
