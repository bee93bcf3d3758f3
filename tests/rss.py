"""Peak resident memory of a block: ``globaltensor.testing.peak_rise``."""
from globaltensor.testing import Peak, peak_rise  # noqa: F401
