import sys

from moeless.cli import main

sys.exit(main())
