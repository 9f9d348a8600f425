import sys

from rlfleet.cli.main import main

sys.exit(main())
