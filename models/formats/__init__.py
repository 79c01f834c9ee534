"""Export formats beyond TorchScript/ONNX/OpenVINO, one module each: its export, its backend and its metadata."""
