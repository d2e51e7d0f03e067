"""Frontends: torch (fx symbolic trace, torch.export) and ONNX, lifted into the partition IR."""
