import sys

from m3jax.cli import main

sys.exit(main())
