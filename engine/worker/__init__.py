"""The worker: the model runner and its transformers twin, the KV pool, the per-step device inputs
(block tables, sampling rows, grammar masks, decode inputs), prompt logprobs and piecewise CUDA
graphs. It runs the scheduler's steps (``engine.scheduling``) on the model code (``engine.model``)."""
