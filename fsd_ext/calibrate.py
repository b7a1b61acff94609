"""fsd_ext.calibrate, the import path of threshold calibration, which lives in
fsd_ext/decoding/calibrate.py."""

from .decoding.calibrate import (CALIBRATE_RULES, CALIBRATION_GRID, Calibration, CalibrationPoint,  # noqa: F401
                                 calibrate, check_calibrate_options, format_points)
