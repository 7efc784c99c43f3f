"""The engine core: ``LLMEngine``, the config it is built from (``EngineArgs`` -> ``EngineConfig``,
the model's source and its sampling defaults), and output processing with detokenization. It
drives the scheduler (``engine.scheduling``) and the worker (``engine.worker``); the entrypoints
(``engine.entrypoints``) are its clients."""
