import sys

from lmcache_ascend.cli.main import main

sys.exit(main())
