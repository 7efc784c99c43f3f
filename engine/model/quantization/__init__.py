"""Quantized weights (phase 12): FP8 formats (``scheme``), the FP8 linear and expert layers
(``fp8_layers``), and building a model in them (``build``, reached from
``engine.model.models.registry.build_model`` when ``ModelConfig.quantization`` is set)."""
