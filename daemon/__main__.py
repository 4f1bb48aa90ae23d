import sys

from kvswap.daemon.main import main

sys.exit(main())
