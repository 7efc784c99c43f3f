"""The model code: model configs and the safetensors loader, the models and their layers, the
kernels behind one interface, and FP8 quantization. It never imports the engine above it."""
