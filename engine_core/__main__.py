import sys

from engine_core.cli import main

sys.exit(main())
