"""`python -m fairgate ...`: the same as the `fairgate` command."""

import sys

from fairgate.cli import main

sys.exit(main())
