import sys

from m3jax.cli import main

if __name__ == "__main__":  # not when a spawned process (the engine's) imports this module as its parent's main
    sys.exit(main())
