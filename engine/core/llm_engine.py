"""LLMEngine: requests in, outputs out, over a scheduler, a model runner and an output processor.

``add_request`` / ``step`` / ``abort_request`` / ``pop_request`` drive a loop (the server's):
each ``step`` returns what every request's output gained (its new tokens, text and logprobs, and
its finish), so a stream consumes what is pushed to it; ``request_output`` is a request's whole
output. ``generate`` (text) and ``generate_tokens`` (token ids) run prompts to the end;
``begin_generation`` / ``has_unfinished_requests`` / ``get_generation_outputs`` queue prompts and
read their texts. A step is: the scheduler picks the batch, the runner launches it, the previous
launch is read back (``postprocess``): the scheduler appends its tokens and the output processor
turns them into each request's output. Under torchrun every rank runs the same engine loop on
the same requests (``engine.core.lockstep``): only rank 0 samples and broadcasts, so every rank
schedules the same steps. Request ids are counters, identical on every rank.
"""
from __future__ import annotations

import itertools
import logging
import sys
import time
from pathlib import Path

from engine.core.engine_args import EngineArgs
from engine.core.engine_config import EngineConfig
from engine.core.output_processor import OutputProcessor, RequestOutput
from engine.core.sampling_defaults import GREEDY, read_generation_config, sampling_defaults
from engine.core.tokenizer import load_tokenizer
from engine.distributed import all_reduce_path, init_custom_all_reduce, init_tp_distributed
from engine.model import kernels
from engine.model.config import ModelConfig
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import SamplingParams, Sequence
from engine.worker.hf_runner import HFModelRunner
from engine.worker.model_runner import ModelRunner
from engine.worker.runner import LaunchedStep, Runner

log = logging.getLogger(__name__)


def _eos_token_ids(generation_config: dict, config: ModelConfig, tokenizer) -> set[int]:
    ids = set(config.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    """Serves requests through continuous batching, built from a resolved ``EngineConfig``:
    ``LLMEngine(config)``, or ``LLMEngine(model_dir, **options)``, which resolves
    ``EngineArgs(model=model_dir, backend=inference_backend, **options)`` first (no ``model_dir``:
    the demo model shipped in ``engine/default_model``). The options and their defaults are
    ``EngineArgs``'s fields; ``EngineConfig``'s sections say how each default is decided.

    ``inference_backend``: "tp" routes by ``config.json`` ``architectures[0]``; "qwen_tp" /
    "deepseek_tp" force a family; "hf" runs transformers' model under our scheduler (always
    synchronous). With ``overlap`` (the default) each ``step`` launches the next batch before it
    reads back the batch the previous ``step`` launched, so the host schedules, stages and
    postprocesses while the device computes; the tokens are those of synchronous steps.
    ``speculative="ngram"`` drafts tokens by prompt lookup and verifies them in the decode step
    (``engine.scheduling.speculative``), giving plain decoding's tokens; its drafts need every token on the
    host, so its steps are synchronous (overlap is turned off: an INFO line on this module's logger
    saying "overlap is off"; the hf backend refuses speculation with a ValueError naming the "hf
    backend"). At its start rank 0 prints ``summary()`` to stderr (the start line a CLI user sees).

    A request whose step raised ends with ``error`` "the engine failed on this request: <exception
    type>: <message>". A token id outside the vocabulary is a ValueError naming
    ``SamplingParams.<field>``; the hf backend refuses the features it lacks naming "constraints".

    Requests with ``structured`` params (a grammar) are masked by phase 14's grammar state, reached
    only through ``grammar_compiler``, ``_add_grammar`` and ``_advance_grammars``; their steps read
    back the token the next mask needs before planning it.

    ``engine_config`` is the resolved config; ``config`` the checkpoint's ``ModelConfig``. The
    server and the benchmarks read ``model_dir``, ``dtype``, ``device``, ``overlap``,
    ``max_model_len``, ``generation_config``, ``tokenizer``, ``num_steps``, ``host_seconds`` (time
    ``step()`` spent on the host, device waits excluded) and ``num_prompt_tokens`` (of the requests
    admitted).
    """

    def __init__(self, model_dir: str | Path | EngineConfig | None = None, inference_backend: str = "tp",
                 **options):
        if isinstance(model_dir, EngineConfig):
            if options or inference_backend != "tp":
                raise TypeError("LLMEngine(config) takes no other options: they are the config's")
            engine_config = model_dir
        else:
            engine_config = EngineArgs(model=model_dir, backend=inference_backend, **options).create_engine_config()
        self.engine_config = c = engine_config
        self.config, self.model_dir, self.dtype = c.model.config, c.model.model_dir, c.model.dtype
        self.device, self.overlap = c.parallel.device, c.scheduler.overlap
        self.max_model_len = c.scheduler.max_model_len
        kernels.configure(c.kernels)  # before any layer is built: layers read decode_gemv then
        self.tokenizer = load_tokenizer(self.model_dir)
        self.tp = init_tp_distributed()
        if c.parallel.custom_all_reduce:
            init_custom_all_reduce(self.device)  # a no-op for one rank or a CPU device
        self.generation_config = read_generation_config(self.model_dir)
        self.eos_token_ids = _eos_token_ids(self.generation_config, self.config, self.tokenizer)
        self.sampling_defaults = sampling_defaults(self.generation_config, GREEDY)
        if c.speculative.method is not None:
            log.info("speculative decoding runs synchronous steps (its drafts need every token on the host): "
                     "overlap is off")
        self.runner: Runner = (ModelRunner(c, self.tp, self.eos_token_ids) if c.model.model_class is not None
                       else HFModelRunner(c, self.tp))
        drafter = c.speculative.drafter() or getattr(self.runner, "drafter", None)
        self.block_manager = BlockManager(self.runner.num_blocks, c.cache.block_size, c.cache.enable_prefix_caching)
        self.scheduler = Scheduler(c.scheduler, self.block_manager, self.eos_token_ids, drafter, self._release)
        self.outputs = OutputProcessor(self.tokenizer, keeps_text=self.tp.rank == 0)
        self._in_flight: LaunchedStep | None = None  # launched by the last step(), not read back yet
        self._grammar_compiler = None  # built by the first use of grammar_compiler (rank 0)
        self._grammars = None  # phase 14's GrammarRows, built for the first grammar request (rank 0)
        self._ids = itertools.count()
        self._generation: list[str] = []
        self.num_steps = 0
        self.host_seconds = 0.0  # time step() spent on the host, waits for the device excluded
        self.num_prompt_tokens = 0  # of the requests admitted
        if self.tp.rank == 0:
            print(self.summary(), file=sys.stderr, flush=True)

    def summary(self) -> str:
        """One line (printed to stderr at the start, rank 0): the config's choices and what loading
        made of them, e.g. "eager", "overlapped steps" or "synchronous steps", "n-gram speculation
        (k=4, n=1..3)"."""
        c, r = self.engine_config, self.runner
        kv_tokens = r.num_blocks * c.cache.block_size
        steps = f"CUDA graphs for batch sizes up to {max(r.graphs)}" if getattr(r, "graphs", None) else "eager"
        if getattr(r, "prefill_graphs", None) is not None and r.prefill_graphs.sizes:
            steps += (f", piecewise graphs for prefill steps up to {max(r.prefill_graphs.sizes)} tokens "
                      f"({len(r.prefill_graphs.sizes)} sizes, captured in {r.prefill_graphs.capture_seconds:.1f} s)")
        steps += ", overlapped steps" if c.scheduler.overlap else ", synchronous steps"
        if c.scheduler.prefill_tokens_beside_decodes:
            steps += f", at most {c.scheduler.prefill_tokens_beside_decodes} prompt tokens beside decodes"
        spec = c.speculative
        if spec.method == "ngram":
            steps += (f", n-gram speculation (k={spec.num_speculative_tokens}, n={spec.prompt_lookup_min}.."
                      f"{spec.prompt_lookup_max})")
        elif spec.method is not None:
            source = spec.draft_model or "the checkpoint's MTP layer"
            steps += f", {spec.method} speculation (k={spec.num_speculative_tokens}, from {source})"
        runner = "transformers" if isinstance(r, HFModelRunner) else type(r.model).__name__
        tp_detail = f" ({all_reduce_path()} all-reduce)" if self.tp.size > 1 else ""
        return (f"agent-infer: {self.config.architecture} ({runner}) from {c.model.model_dir} | {c.model.dtype} on "
                f"{c.parallel.device} | {steps} | tp {self.tp.size}{tp_detail} | "
                f"weights {r.weight_bytes / 2**30:.2f} GiB per rank | "
                f"KV cache {r.num_blocks} blocks = {kv_tokens} tokens = {r.kv_cache_bytes / 2**30:.2f} GiB"
                f"{'' if c.cache.dtype is None else f' in {c.cache.dtype}'} | "
                f"max_model_len {c.scheduler.max_model_len} | loaded in {r.load_seconds:.1f} s")

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    detokenize: bool = True, client: str = "") -> str:
        """Queue a prompt (text, or token ids) and return its request id. ``client`` names who
        sent it (a server's client key): waiting requests are admitted round robin over clients,
        first come, first served within one (the scheduler's admission order), so requests all
        added with the default "" start in the order added. A prompt that can never run (longer
        than max_model_len, or needing more KV blocks than exist) is finished at
        once as "rejected"; its output names the reason. A ``structured`` spec is compiled here
        (``grammar_compiler.compile``: a cache hit once ``compile_async`` has run for it); one that
        cannot be compiled raises its ``StructuredOutputError`` (a ValueError) and queues nothing."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not token_ids:
                raise ValueError("prompt encodes to no tokens")
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        params = sampling_params or SamplingParams()
        self._check_params(params)
        seq = Sequence(token_ids, params, request_id=str(next(self._ids)), client=client)
        if params.structured is not None:
            self._add_grammar(seq)
        self.outputs.add(seq, detokenize)
        if self.scheduler.add(seq):
            self.num_prompt_tokens += seq.num_prompt_tokens
        else:
            log.warning("request %s rejected: %s", seq.request_id, seq.reject_reason)
            self._release(seq)
            self.outputs.finish(seq.request_id)
        return seq.request_id

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: ids within this model's vocabulary, and the
        features the hf backend lacks."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.config.vocab_size
        ids = {"stop_token_ids": params.stop_token_ids, "logit_bias": [t for t, _ in params.logit_bias],
               "allowed_token_ids": params.allowed_token_ids or (),
               "bad_words_token_ids": [t for word in params.bad_words_token_ids for t in word]}
        for name, values in ids.items():
            if any(t >= vocab for t in values):
                raise ValueError(f"SamplingParams.{name} must hold token ids in [0, {vocab}), got "
                                 f"{getattr(params, name)!r}")
        if self.engine_config.model.model_class is None and (params.penalized or params.min_tokens or
                                                       params.logprobs is not None or params.constrained or
                                                       params.prompt_logprobs is not None):
            raise ValueError("the hf backend does not apply penalties, min_tokens or constraints (logit_bias, "
                             "allowed_token_ids, bad words, structured outputs) and returns no logprobs or "
                             "prompt logprobs")

    def _release(self, seq: Sequence) -> None:
        """The scheduler freed ``seq``'s blocks (finished, or preempted) or rejected it: its runner
        rows go, and a finished one's grammar state."""
        self.runner.release(seq)
        if seq.is_finished and self._grammars is not None:
            self._grammars.remove(seq.request_id)

    @property
    def grammar_compiler(self):
        """The ``GrammarCompiler`` of structured outputs over this engine's tokenizer (vocabulary
        ``config.vocab_size``, stop tokens the EOS ids), built at first use; None on TP ranks
        other than 0 (only rank 0 samples, so only it holds grammars). A server awaits
        ``compile_async(spec)`` off the engine loop before ``add_request``."""
        if self._grammar_compiler is None and self.tp.rank == 0:
            from engine.scheduling.structured.compiler import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _add_grammar(self, seq: Sequence) -> None:
        """Compile ``seq``'s spec and start its grammar (rank 0; the first one builds the
        ``GrammarRows`` the runner's sampling masks with). A spec that cannot be compiled raises
        its ``StructuredOutputError`` on every rank (rank 0's message is broadcast)."""
        from engine.distributed import broadcast_object
        from engine.scheduling.structured.spec import StructuredOutputError
        from engine.worker.grammar_rows import GrammarRows

        error = None
        if self.tp.rank == 0:
            if self._grammars is None:
                self._grammars = GrammarRows(self.grammar_compiler, self.engine_config.scheduler.max_num_seqs,
                                             self.device)
                self.runner.sampling.grammar = self._grammars
            try:
                self._grammars.add(seq)
            except StructuredOutputError as e:
                error = (e.param, str(e))
        error = broadcast_object(error)
        if error is not None:
            raise StructuredOutputError(*error)

    def _advance_grammars(self, outputs: list) -> list[tuple[str, str, str | None]]:
        """Advance the grammars by a step's read-back outputs (rank 0) and return, on every rank,
        the (request id, reason, error) of the requests they end (``GrammarRows.advance``)."""
        from engine.distributed import broadcast_object

        return broadcast_object(self._grammars.advance(outputs) if self._grammars is not None else [])

    def abort_request(self, request_id: str) -> bool:
        """Finish an unfinished request with reason "abort" (the next ``step`` pushes it); its
        blocks are freed (at once, or after the step in flight that holds it). False for an
        unknown or finished request."""
        return self._end_request(request_id, "abort")

    def _end_request(self, request_id: str, reason: str, error: str | None = None) -> bool:
        """End an unfinished request with ``reason`` (the scheduler finishes it and frees its
        blocks; its output is pushed, with ``error`` when it failed); False when no unfinished
        request has this id."""
        if not self.scheduler.finish(request_id, reason):
            return False
        self.outputs.finish(request_id, error)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_generation_tokens(self) -> int:
        """Output tokens that reached a request's output so far."""
        return self.outputs.num_generation_tokens

    def request_output(self, request_id: str) -> RequestOutput:
        """The request's whole output so far (a stream reads what ``step`` pushes instead). A
        running request's text stops short of what could still become a stop string."""
        return self.outputs.output(request_id)

    def take_outputs(self) -> list[RequestOutput]:
        """What ``step`` returns: per request whose output gained anything since it was last
        taken, a ``RequestOutput`` of what it gained (``OutputProcessor.take_outputs``). A caller
        whose ``step`` raised takes the finish of the requests that step failed here."""
        return self.outputs.take_outputs()

    def request_ids(self) -> list[str]:
        """The requests the engine holds: unfinished, or finished and not popped."""
        return self.outputs.request_ids()

    def sequence(self, request_id: str) -> Sequence:
        """The request's ``Sequence`` as the scheduler keeps it (read only: tests and tools inspect it)."""
        return self.outputs.sequence(request_id)

    def pop_request(self, request_id: str) -> RequestOutput:
        """A finished request's output, forgotten by the engine."""
        output = self.request_output(request_id)
        if not output.finished:
            raise ValueError(f"request {request_id} is not finished")
        self.outputs.remove(request_id)
        return output

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns what each request's output gained since the last call
        (``take_outputs``: new tokens, text and logprobs, and the finish; rejected and aborted
        requests included; not those popped meanwhile).

        Schedules the next batch and launches it. With overlap, the batch the previous call
        launched is then read back and postprocessed while the new one runs (its tokens feed the
        new batch on the device); without, the new batch is read back at once. A request that
        ends at step N may have had step N+1 computed for it: that token is dropped. When no
        request is left, or a decode found no free block while a step was in flight, the step
        in flight is postprocessed first, so an idle engine holds no block. So is a step in flight
        that sampled a token for a request whose constraints read its output (a grammar,
        multi-token bad words): the next step's mask needs that token (that step is synchronous;
        plain batches keep the overlap)."""
        start, waited = time.perf_counter(), 0.0
        try:
            if self._in_flight is not None and (self.scheduler.needs_drain or _reads_output(self._in_flight.batch)):
                waited += self.postprocess(self._take_in_flight())
            batch = self.scheduler.schedule()
            previous = self._in_flight
            self._in_flight = self.runner.launch(batch, previous) if batch.seqs else None
            self.num_steps += bool(batch.seqs)
            if previous is not None:
                waited += self.postprocess(previous)
            if self._in_flight is not None and not (self.overlap and self.scheduler.has_unfinished()):
                waited += self.postprocess(self._take_in_flight())
        except Exception as e:
            self._in_flight = None
            for seq in self.scheduler.fail_in_flight():
                self.outputs.finish(seq.request_id, f"the engine failed on this request: {type(e).__name__}: {e}")
            raise
        finally:
            self.host_seconds += time.perf_counter() - start - waited
        if not batch.seqs and previous is None and self.scheduler.has_unfinished() and not self.scheduler.running:
            # nothing runs and nothing fits: never wait forever
            for seq in self.scheduler.reject_waiting("could not be scheduled on an idle engine"):
                self.outputs.finish(seq.request_id)
        return self.outputs.take_outputs()

    def _take_in_flight(self) -> LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        return launched

    def postprocess(self, launched: LaunchedStep) -> float:
        """The second half of a step: read back a launched step's tokens and hand them to the
        scheduler, then its outputs to the output processor, ending the requests a stop string (or
        undecodable text) ended, and the grammars advanced by the tokens that reached the outputs
        (a complete grammar ends its request with "stop", a refused token with "error"; a token
        that ends the request itself, EOS or max_tokens, ends it with that reason). Returns the
        seconds spent waiting for the device. ``step`` calls
        it; a test that schedules and launches a batch by hand completes it here."""
        start = time.perf_counter()
        token_ids = launched.token_ids()
        waited = time.perf_counter() - start
        result = self.scheduler.postprocess(launched.batch, token_ids)
        self.outputs.add_prompt_logprobs(launched.prompt_logprobs())
        for request_id, reason in self.outputs.process_outputs(result.outputs, launched.logprobs()):
            self.scheduler.finish(request_id, reason)  # its output has ended: pushed by this step
        if any(out.seq.sampling_params.structured is not None for out in result.outputs):
            for request_id, reason, error in self._advance_grammars(result.outputs):
                self._end_request(request_id, reason, error)
        return waited

    # ---- whole prompts to the end --------------------------------------------------------------

    def begin_generation(self, prompts: str | list[str], sampling_params: SamplingParams | None = None,
                         **sampling) -> list[str]:
        """Queue ``prompts`` (sampling as in ``generate``); returns their request ids."""
        params = sampling_params or _sampling_params(**sampling)
        prompts = [prompts] if isinstance(prompts, str) else prompts
        self._generation = [self.add_request(p, params) for p in prompts]
        return self._generation

    def get_generation_outputs(self) -> list[str]:
        """The texts of the last ``begin_generation``'s prompts, in order ("" for rejected ones)."""
        return [self.request_output(rid).text for rid in self._generation]

    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop: str | list[str] | None = None, seed: int | None = None,
                 ignore_eos: bool = False, sampling_params: SamplingParams | None = None) -> str | list[str]:
        """Completions of ``prompts`` (one string in, one string out). Rejected prompts give ""
        and a warning; the others complete."""
        params = sampling_params or _sampling_params(max_new_tokens, temperature, top_p, top_k, stop, seed,
                                                     ignore_eos)
        ids = self.begin_generation(prompts, params)
        self._run_to_completion()
        texts = [self.pop_request(rid).text for rid in ids]
        self._generation = []
        return texts[0] if isinstance(prompts, str) else texts

    def generate_tokens(self, prompts: list[list[int]], sampling_params: SamplingParams) -> list[list[int]]:
        """Output token ids for prompts given as token ids (no detokenisation)."""
        ids = [self.add_request(p, sampling_params, detokenize=False) for p in prompts]
        self._run_to_completion()
        return [self.pop_request(rid).token_ids for rid in ids]

    def _run_to_completion(self) -> None:
        """Step until every request has finished; the caller collects the outputs itself."""
        while self.has_unfinished_requests():
            self.step()
        self.take_outputs()


def _reads_output(batch) -> bool:
    """``batch`` sampled a token for an unfinished request whose constraints read its output."""
    return any(samples and seq.sampling_params.reads_output and not seq.is_finished
               for seq, samples in zip(batch.seqs, batch.samples))


def _sampling_params(max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     stop: str | list[str] | None = None, seed: int | None = None,
                     ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                          stop=stop or (), seed=seed, ignore_eos=ignore_eos)
