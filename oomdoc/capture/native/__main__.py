import sys

from oomdoc.capture.native import main

sys.exit(main())
