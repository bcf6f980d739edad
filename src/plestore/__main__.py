import sys

from plestore.cli import main

sys.exit(main())
