"""`python -m tunelib.launch`: see `tunelib.launch`."""

import sys

from tunelib.launch import main

sys.exit(main())
