import sys

from shardc.cli import main

sys.exit(main())
