"""Quantization to a standard integer target, for detectors the chip cannot run (PP-YOLO).

The chip runs only GNetDet's 3x3 convolutions (gnetmdk.gti). A model with 1x1 and strided convs,
residual adds, concatenations and upsampling goes through the same stages instead to the integer
arithmetic of the common int8 runtimes (Jacob et al., "Quantization and Training of Neural Networks
for Efficient Integer-Arithmetic-Only Inference", CVPR 2018; the ONNX QOperator ops):

* **Weights** (step 2 on): BatchNorm folded into the conv; each conv's weights fake-quantized per
  output channel, symmetric, ``b`` bits (8 by default, 4..8): ``W_q = clamp(round(W / s_c), -Q, Q)``
  with ``Q = 2^(b-1) - 1`` and ``s_c = max|W_c| / Q`` ("max") or the clipped scale that minimises
  the channel's squared error ("mse"). The straight-through estimator passes the gradient of W.
* **Activations** (measured by cal, quantized from step 3): every tensor between integer ops is
  uint8 with a per-tensor scale ``s`` and zero point ``z``: ``q = clamp(floor(x / s + 1/2) + z, 0,
  255)``, ``x ~ s (q - z)``; the range [lo, hi] (lo <= 0 <= hi) comes from calibration, so tensors
  after a ReLU get ``z = 0`` and signed ones (leaky ReLU, residual branches, the normalised image)
  an asymmetric range. The gradient passes inside the range and is zero outside (clipped STE).
* **Integer model** (step 4, gnetmdk.intq.program): int8 weights, int32 accumulators and biases
  (``b_q = round(b / (s_x s_w))``), and fixed-point requantization: ``q_out = clamp(floor((acc M_c
  + 2^(n-1)) / 2^n) + z_out, lo, 255)`` with an integer multiplier ``M_c`` (``m_c = s_x s_w,c /
  s_out`` rounded to 31 significant bits) and one shift ``n`` per layer; rounding is half up.
  ReLU is the clamp at ``z_out``; leaky ReLU a second multiplier for negative accumulators. Adds
  rescale both inputs to the output scale the same way; concatenations requantize each input to
  the output's scale; max pooling and nearest upsampling act on the codes. The detection head's
  accumulators are dequantized to float32 (``acc * s_x * s_w,c`` in float64, rounded once).

The integer model is written as ONNX in two forms: integer operators that equal step 4 bit for bit
(gnetmdk.intq.onnx_export), and the QDQ form the int8 runtimes take, whose distance from step 4 is
measured (gnetmdk.intq.qdq_export; step 4's ``requant "float"`` rounds its convs as those runtimes do).

What a family provides is a graph (gnetmdk.intq.graph): nodes naming its modules, which the
fake-quantized forward, calibration, the integer program and the ONNX export all read.
"""
