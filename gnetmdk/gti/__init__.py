"""The Lightspeeur chips' arithmetic: quantizers as pure functions with straight-through gradients, the
histogram and MSE choice both calibrations share (quantize.py), chips and weight formats (spec.py), BN
folding and gain editing (transforms.py), memory limits (memory.py), per-layer sensitivity
(sensitivity.py); docs/quantization.md. The chip model built from a network is gnetmdk.chip."""
