"""Fitting and measuring maps offline: the one calibration loop (`loop`: capture -> sufficient statistics ->
ridge -> `KVMap`, checkpointed, sharded under torchrun), what a pass accumulates (`statistics`), the ridge fit itself
(`fit`), checkpoints (`checkpoint`), the blend of same-shape maps (`blend`), nonlinear residual heads (`nonlinear`),
distillation by the target's KL (`distill`), the attention bonus of mapped keys (`bonus`), the quality gate (`gate`),
the retention metrics (`retention`) and the bootstrap their intervals share (`bootstrap`).

May import `runtime` (evaluation runs the mapped cache as inference does), `maps`, `modeling`, `lab` and the
foundation; nothing imports it but the CLI, the serve command (``--calibrate-missing``) and the two ``calibrate``
classmethods.
"""
