import sys

from vgpu_runtime.daemon.main import main

sys.exit(main())
