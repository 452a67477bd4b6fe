"""Calibration of the chip's activation caps: gnetmdk.models.calibration, re-exported here for the trainer
and the tools. It is the families' default calibration (gnetmdk.models.base.DetectorFamily.calibrate),
so it sits on the models' floor."""
from gnetmdk.models.calibration import (CAP_HIST_BINS, OUTPUT_BATCHES, OUTPUT_FACTORS, calibrate_caps, measure_caps,
                                        percentile, refine_caps_for_output)

__all__ = ["CAP_HIST_BINS", "OUTPUT_BATCHES", "OUTPUT_FACTORS", "calibrate_caps", "measure_caps", "percentile",
           "refine_caps_for_output"]
