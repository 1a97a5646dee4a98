"""python -m launch.gpu_check: tfscale-gpu-check."""

import sys

from launch.gpu_check.cli import main

sys.exit(main())
