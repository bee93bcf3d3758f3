"""``python -m globaltensor.launch ...``: see ``globaltensor.launch``."""

from . import main

if __name__ == "__main__":
    main()
