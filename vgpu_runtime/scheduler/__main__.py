import sys

from vgpu_runtime.scheduler.main import main

sys.exit(main())
