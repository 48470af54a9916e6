"""``python -m ray_elastic`` = the ``ray-elastic`` command."""

import sys

from ray_elastic.cli import main

sys.exit(main())
