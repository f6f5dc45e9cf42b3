"""`python -m h3serve.cli`: the `h3serve` command."""

import sys

from h3serve.cli import main

sys.exit(main())
