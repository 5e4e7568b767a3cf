import sys

from vgpu_runtime.daemon.host.main import main

sys.exit(main())
