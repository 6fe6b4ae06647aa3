"""The speculative engine's step loop (synchronous core).

Each ``step()``: schedule; run ONE target forward over prefill chunks, pending
tokens and drafts of all requests; turn logits into target distributions with
each request's sampling params and verify the drafts (``_verify``: a
``Verified`` on each sampled entry of the step); commit accepted tokens and roll
back the rest; emit per-request token deltas and metric events; then propose up
to K (``num_spec_tokens``) drafts for every decoding request, verified next step.

A request's drafts may be a tree (``method.tree``: ``Drafts.parents``): its nodes run
as one sequence with tree masks, ``sampling.tree`` verifies it, and the accepted path's
K/V is moved from its nodes' slots to the positions after the root before the next
step (``_compact_trees``).  Requests whose verification needs logits controls draft
chains beside them.

A request's state is one ``RequestState`` in ``self.requests``
(``engine.requests``): created on admission, torn down only by
``RequestTable.release``, which finishing (``_finish``: stop, length, abort,
failure) and preemption call.

Detokenisation and stop strings (``specserve.engine.output``) run where the
caller wants them: after each step here when ``detokenize`` is True (offline
use), or in the consumer of each request's stream (``AsyncEngine`` turns it off
so the engine thread only runs the model).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.config import Config
from specserve.engine.output import OutputProcessor
from specserve.engine.reasoning_gate import constraint_state, grammar_drafts
from specserve.engine.requests import Drafts, RequestBlocks, RequestState, RequestTable, Verified
from specserve.kv_blocks import BlockManager
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.engine.stats import RequestFinishedStats, RequestStepStats, StatsListener, StepStats
from specserve.engine.tokenizer import Tokenizer, bad_words_token_ids
from specserve.engine.spec_control import SpecController, tree_depth_choices
from specserve.errors import InvalidRequestError, RequestFailedError, SpecServeError
from specserve.generation_defaults import read_defaults
from specserve.formats import load_chat_template
from specserve.formats import resolve as resolve_formats
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, load_model, resolve_device
from specserve.executor.batch import SeqInput, StepBatch, draft_sizes, tree_depths
from specserve.executor.batch import tree_masks as tree_attention_masks
from specserve.executor.backends.factory import RunnerFactory
from specserve.kernels.backends import choose_rejection
from specserve.parallel.plan import draft_tensor_parallel_size
from specserve.proposers import DraftRequest, Proposer, build_proposer
from specserve.methods import Q_VERIFICATION_METHODS, as_method_options, get_method
from specserve.proposers.base import ProposerContext, TargetShape, memory_needs
from specserve.proposers.prediction import PredictedOutputs
from specserve.request import GREEDY_EPS, FinishReason, RequestOutput, SamplingParams
from specserve.sampling.philox import random_seed, seed_to_int64
from specserve.sampling.sampler import DeviceSampler, RequestTensors, unpack
from specserve.sampling.tree import greedy_tree_paths, node_argmax, tree_inputs, unpack_trees, verify_trees
from specserve.engine.step_controls import logprob_lists, plan_step
from specserve.engine.memory import DeviceFigures, MemoryBudget, plan_memory
from specserve.sampling.logits_controls import logprob_columns

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    model_name: str
    method: str  # "none" without speculation
    num_speculative_tokens: int
    max_model_len: int
    dtype: str
    device: str
    lossless: bool
    # Layout (specserve.parallel): ranks the target is sharded over, and the draft model's.
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    # What runs the kernels (kernels.backends): "triton" or "torch" (the twin; "cpu_fused":
    # the CPU's fused decoder), after the start-up checks.
    attention_backend: str = "torch"
    rejection_backend: str = "torch"
    vocab_size: int | None = None  # token ids a request may use: [0, vocab_size)
    # Defaults for fields a request leaves out, from the model's generation_config.json
    # (model.generation_config; specserve.generation_defaults): SamplingParams' names.
    sampling_defaults: dict = field(default_factory=dict)
    # The model's tool-call and reasoning formats (specserve.formats; None: none)
    tool_call_format: str | None = None
    reasoning_format: str | None = None


def memory_budget(cfg: Config, target: LoadedModel, num_spec_tokens: int, graphs: bool, static: bool, extra_layers: int,
                  with_method: bool = True, device: DeviceFigures | None = None) -> MemoryBudget:
    """The device memory budget (``engine.memory``), asked before the KV cache is sized:
    the method declares its part from its config files; on CUDA the device is measured
    here (the profiled transients only where the KV size is not given).  ``device``
    overrides the measurement (tests: meta tensors and a device figure)."""
    e, spec = cfg.engine, cfg.method
    needs = None
    if spec is not None and with_method:
        shape = TargetShape(target.arch, target.dtype.itemsize, target.max_model_len, target.hf_dir,
                            cuda=target.device.type == "cuda", cuda_graphs=graphs)
        needs = memory_needs(spec, shape, e, cfg.draft)
    if device is None and target.device.type == "cuda":
        from specserve.executor.device_profile import profile_cuda_memory

        if e.num_kv_blocks is not None or e.kv_cache_memory_gib is not None:
            _, total = torch.cuda.mem_get_info(target.device)
            device = DeviceFigures(int(total), int(torch.cuda.memory_allocated(target.device)))
        else:
            # the largest eager step
            tokens = max(e.max_num_batched_tokens, e.max_num_seqs * (num_spec_tokens + 1))
            p = profile_cuda_memory(target, tokens, e.block_size, e.max_num_seqs, num_spec_tokens)
            device = DeviceFigures(p.total_bytes, p.held_bytes, p.activation_bytes, p.verify_bytes)
    return plan_memory(cfg, target, num_spec_tokens=num_spec_tokens, graphs=graphs, static=static,
                       extra_layers=extra_layers, needs=needs, device=device)


class LLMEngine:
    def __init__(self, cfg: Config, target: LoadedModel | None = None, proposer: Proposer | None = None):
        self.cfg = cfg
        e = cfg.engine
        if e.num_threads is not None:
            torch.set_num_threads(e.num_threads)
        device = resolve_device(e.device)
        tp = cfg.parallelism.tensor_parallel_size
        if target is None and tp > 1:  # rank 0 of a tensor-parallel group (started here if need be)
            from specserve.parallel.launch import load_target

            target = load_target(cfg)
        if target is None:
            m = cfg.model
            target = load_model(m.path, m.dtype, device, m.max_model_len, m.cache_dir, cpu_kernel=e.cpu_kernel,
                                tokenizer_path=m.tokenizer)
        self.target = target
        self.tokenizer = Tokenizer(target.tokenizer, target.eos_token_ids, load_chat_template(cfg.model.chat_template))
        self.max_model_len = target.max_model_len
        spec = cfg.method
        # K, the most drafts a request verifies per step: the method's, or without a method
        # engine.num_prediction_tokens (Predicted Outputs alone).
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else e.num_prediction_tokens
        npt = min(e.num_prediction_tokens, self.num_spec_tokens)
        self.predictions = PredictedOutputs(npt) if npt > 0 else None
        sizes = draft_sizes(self.num_spec_tokens)
        # Which backend runs the target (executor.backends.factory), known before the KV cache is sized.
        runners = RunnerFactory.from_engine(e, cfg.model.cache_dir)
        plan = runners.plan(target, target=True)
        extra = get_method(spec.method).kv_layers if spec is not None and proposer is None else 0
        # Every device allocation is counted before the KV cache gets what is left (engine.memory).
        self.memory_budget = memory_budget(cfg, target, self.num_spec_tokens, plan.graphs, plan.static and plan.cuda,
                                           extra, with_method=proposer is None)
        log.info("%s", self.memory_budget.line())
        num_blocks = self.memory_budget.num_blocks
        a = target.arch
        self.kv = KVCache(a.num_layers + extra, num_blocks, e.block_size, a.num_kv_heads, a.head_dim, target.dtype,
                          target.device)
        self.blocks = BlockManager(num_blocks, e.block_size, enable_caching=e.enable_prefix_caching)
        self._prefix_reported = (0, 0)  # prefix-cache (queried, hit) tokens already in StepStats
        # ``proposer``: one built by the caller (the head trainer's feature recorder)
        self.proposer: Proposer | None = proposer
        # Triton or its twin for attention: checked on the target's geometry before anything
        # launches it; drafters are handed the outcome as their engine.attention_backend.
        attention = runners.attention(target)
        if spec is not None and proposer is None:
            drafting = dataclasses.replace(e, attention_backend=attention.used) if attention is not None else e
            ctx = ProposerContext(target=target, draft_model=cfg.draft, engine=drafting, num_kv_blocks=num_blocks,
                                  kv=self.kv, kv_blocks=RequestBlocks(self.blocks),
                                  cache_dir=Path(cfg.model.cache_dir) if cfg.model.cache_dir else None)
            self.proposer = build_proposer(spec, ctx)
            if spec.rejection_sample_method == "synthetic":
                log.warning(
                    "rejection_sample_method=synthetic: acceptance is simulated at rate %s; outputs are NOT "
                    "lossless (benchmarking only)", spec.synthetic_acceptance_rate,
                )
        self.aux_layer_ids: tuple[int, ...] = tuple(getattr(self.proposer, "aux_layer_ids", ()) or ())
        # Graphs capture decode (q = 1) and every verification size an adaptive step may choose.
        # Draft trees (method.tree): steps carry tree masks; uniform tree steps are captured too.
        trees = spec is not None and spec.tree is not None and spec.tree.enabled
        self.runner = runners.target(target, self.kv, graph_query_lens=(1, *(k + 1 for k in sizes)),
                                     aux_layer_ids=self.aux_layer_ids, attention=attention, trees=trees,
                                     tree_query_lens=tuple(k + 1 for k in sizes) if trees else ())
        # Decode/verification steps padded to one draft length, so a captured graph fits.
        self.uniform_steps = plan.graphs
        # auto: adaptive with a method everywhere, and for Predicted Outputs alone on CUDA
        # (on the CPU those stay fixed: measured there with K every step).
        adaptive = e.speculation == "adaptive" or (e.speculation == "auto" and (plan.cuda or spec is not None))
        self.spec_control = SpecController(self.num_spec_tokens, adaptive=adaptive and self.num_spec_tokens > 0,
                                           candidates=sizes, max_num_seqs=e.max_num_seqs, trees=trees,
                                           tree_depths=tree_depth_choices(spec.tree) if trees else (0,))
        if plan.graphs:
            self.spec_control.seed_costs(self.runner.static.time_graphs())
        frames_beside_text, tokens_beside_text, tokens_per_step = cfg.audio.yielding(target.device.type == "cuda")
        self.scheduler = Scheduler(self.blocks, e.max_num_seqs, e.max_num_batched_tokens, self.num_spec_tokens,
                                   self.max_model_len, e.long_prefill_token_threshold,
                                   pending_drafts=lambda seq: self.requests.num_pending_drafts(seq),
                                   background_tokens=tokens_beside_text,
                                   background_tokens_alone=tokens_per_step,
                                   background_period=cfg.audio.yield_period)
        # Speech models: recordings wait for their encoder pass here (engine.speech), the
        # encoder's per-step budget bounding what they add to a step.
        self.speech = None
        if target.speech is not None:
            from specserve.engine.speech import SpeechRequests

            self.speech = SpeechRequests(target, cfg.audio.encoder_frames_per_step, self.proposer,
                                         self.num_spec_tokens, frames_beside_text)
        # Every request's state, and its one teardown (which frees the method's state too).
        self.requests = RequestTable(self.scheduler, [self.proposer, self.predictions, self.speech])
        self.seed_generator = torch.Generator().manual_seed(e.seed)  # seeds of unseeded requests (host)
        verify = spec.rejection_sample_method if spec is not None else "strict"
        rejection = choose_rejection(e.rejection_backend, target.device, verify, target.arch.vocab_size)
        self.sampler = DeviceSampler(
            e.max_num_seqs, self.num_spec_tokens, target.device, verify,
            spec.synthetic_acceptance_rate if spec is not None else None, vocab_size=target.arch.vocab_size,
            use_kernel=rejection.used == "triton",
        )
        self.listeners: list[StatsListener] = []
        self.detokenize = True  # AsyncEngine turns this off and detokenizes per stream
        self._grammar_backend = None  # specserve.structured.GrammarBackend, on first use
        self._grammar_lock = threading.Lock()  # the servers' compile threads ask for it too
        self.info = ModelInfo(
            model_name=cfg.model.name,
            method=spec.method if spec is not None else "none",
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            max_model_len=self.max_model_len,
            dtype=str(target.dtype).removeprefix("torch."),
            device=str(target.device),
            lossless=spec is None or as_method_options(spec).lossless,
            tensor_parallel_size=self.runner.tensor_parallel_size,
            draft_tensor_parallel_size=draft_tensor_parallel_size(spec, self.runner.tensor_parallel_size)
            if plan.tensor_parallel else 1,
            attention_backend=self.runner.attention_backend,
            rejection_backend=rejection.used,
            vocab_size=target.arch.vocab_size,
            sampling_defaults=read_defaults(cfg.model.generation_config, target.hf_dir),
        )
        self.info.tool_call_format, self.info.reasoning_format = resolve_formats(
            cfg.model.tool_call_format, cfg.model.reasoning_format, self.tokenizer.chat_template)

    # ------------------------------------------------------------ requests
    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        V = self.target.arch.vocab_size
        params.validate(vocab_size=V, max_speculative_tokens=self.info.num_speculative_tokens)
        if any((not isinstance(t, int)) or t < 0 or t >= V for t in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids", f"every token id must be an integer in [0, {V})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"is {n} tokens; the model's max_model_len is {self.max_model_len} (room for output needed)"
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({self.max_model_len})",
            )
        if params.audio is not None:
            if self.speech is None:
                raise InvalidRequestError("audio", f"model {self.info.model_name!r} is not a speech model: it takes no "
                                                   "recordings")
            self.speech.validate(prompt_token_ids, params)
        pred = params.prediction_token_ids
        if pred is not None and len(pred) > self.max_model_len:
            raise InvalidRequestError(
                "prediction", f"is {len(pred)} tokens, longer than the model's max_model_len ({self.max_model_len})"
            )
        if params.max_tokens > self.output_room(n):
            need = self.blocks.blocks_for(n + params.max_tokens + self.num_spec_tokens)
            raise InvalidRequestError(
                "max_tokens", f"prompt + max_tokens (+ {self.num_spec_tokens} draft slots) needs {need} KV blocks; "
                f"the cache holds {self.blocks.num_blocks}: at most {max(0, self.output_room(n))} tokens fit",
            )

    def output_room(self, prompt_tokens: int) -> int:
        """The most tokens a request with a ``prompt_tokens``-token prompt may generate: what
        max_model_len leaves after the prompt, and what the KV cache holds for one request
        beside the drafts a step verifies (K: the method's, the prediction drafts', a tree's
        nodes).  The servers' default max_tokens is this (vLLM's max_model_len - prompt)."""
        cache = self.blocks.num_blocks * self.blocks.block_size - self.num_spec_tokens
        return min(self.max_model_len, cache) - prompt_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Admit a request.  Bad input raises InvalidRequestError; any other failure while
        admitting raises RequestFailedError.  Either way nothing of the request remains."""
        prompt_token_ids = params.truncate_prompt(list(prompt_token_ids), self.max_model_len)
        self.validate_request(request_id, prompt_token_ids, params)
        if params.audio is not None:
            params = self.speech.partitioned(params)
        if params.bad_words and params.bad_words_token_ids is None:  # offline: the servers tokenize them
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        st: RequestState | None = None
        try:
            seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                           seed=self._request_seed(params))
            proc = OutputProcessor(self.tokenizer, seq.prompt_token_ids, params) if self.detokenize else None
            grammar = self._grammar_state(params) if params.structured_outputs is not None else None
            grammar = constraint_state(params, grammar, (self.target.arch.vocab_size + 31) // 32)  # reasoning gate
            prompt_lps = [None] if params.prompt_logprobs is not None else None
            st = RequestState(seq, proc, grammar=grammar, prompt_lps=prompt_lps)
            self.requests.add(st)
            if params.audio is not None:  # its prompt waits for the recording's encoder pass
                self.speech.admit(st)
            else:
                self.scheduler.add(seq)
        except Exception as e:
            if st is not None and self.requests.get(request_id) is st:
                self.requests.release(st, finished=True)
            if isinstance(e, SpecServeError):
                raise
            log.exception("admitting request %s failed", request_id)
            raise RequestFailedError(f"admitting the request failed: {type(e).__name__}: {e}") from e

    def _request_seed(self, params: SamplingParams) -> int:
        """The request's Philox key: its own seed, or one drawn from the engine's seed."""
        return seed_to_int64(params.seed) if params.seed is not None else random_seed(self.seed_generator)

    def _fail_request(self, st: RequestState, stage: str, exc: Exception) -> RequestOutput:
        """End one request because handling it failed; its neighbours carry on."""
        if isinstance(exc, SpecServeError):
            failure: Exception = exc
        else:
            log.error("request %s failed while %s", st.seq.request_id, stage, exc_info=exc)
            failure = RequestFailedError(f"the request failed while {stage}: {type(exc).__name__}: {exc}")
        self._finish(st, FinishReason.ABORT)
        out = self._output(st, [])
        out.failure = failure
        return out

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Finish a request now (``reason``: abort, or stop when the caller's output
        processing found a stop string); its KV blocks are freed.  None if unknown."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        self._finish(st, reason)
        out = self._output(st, [])
        if st.proc is not None:
            out = st.proc.process(out)[0]
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks.usage

    # ------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        early = self._encode_audio() if self.speech is not None and len(self.speech) else []
        sched = self.scheduler.schedule()
        for seq in sched.preempted:  # recomputed later from its tokens: its derived state goes
            self.requests.release(self.requests[seq.request_id], finished=False)
        if sched.empty:
            return early
        for s in sched.scheduled:  # drafts proposed after the previous verification; the scheduler sized them
            st = self.requests[s.seq.request_id]
            s.drafts = st.drafts.first(s.draft_room)
            if s.sample:  # a prompt's earlier chunks leave its first drafts for the last one
                st.drafts = Drafts()
        batch = self._build_batch(sched.scheduled)
        prompt_jobs = self._prompt_logprob_rows(sched.scheduled, batch)
        t0 = time.perf_counter()
        fwd = self.runner.execute(batch, self.aux_layer_ids)  # the only failure that may take the engine down
        if prompt_jobs:
            self._prompt_logprobs(prompt_jobs, fwd)
        self._verify(sched.scheduled, fwd)
        self._compact_trees(sched.scheduled)
        outputs = self._commit(sched.scheduled)
        if early:
            outputs = early + outputs
        t1 = time.perf_counter()
        proposed = self._propose_next(sched.scheduled, batch, fwd)
        # a step that proposed for no request says nothing about what proposing costs
        self.spec_control.observe_step(len(sched.scheduled), batch.uniform_query_len(), t1 - t0,
                                       time.perf_counter() - t1 if proposed else None)
        return outputs

    def _build_batch(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        inputs = []
        for s in scheduled:
            seq, d = s.seq, s.drafts.token_ids
            new = seq.token_ids[seq.num_computed : seq.num_computed + s.num_new_tokens] + d
            offsets = list(range(s.num_new_tokens - 1, len(new))) if s.sample else []
            inputs.append(SeqInput(new, seq.num_computed, seq.block_table, offsets, num_drafts=len(d)))
            if self.speech is not None and seq.num_computed < seq.num_prompt_tokens:  # audio rows of a prompt chunk
                inputs[-1].input_embeds = self.speech.input_embeds(self.requests[seq.request_id], seq.num_computed,
                                                                   s.num_new_tokens)
            if s.drafts.parents is not None:
                self._as_tree(inputs[-1], s.drafts.parents, self.target.arch.sliding_window)
        pad_to = None
        if self.uniform_steps and all(s.sample and s.num_new_tokens == 1 for s in scheduled):
            # A decode/verification step: pad drafts to one length so a captured graph fits.
            pad_to = 1 + max(len(s.drafts.token_ids) for s in scheduled)
        return StepBatch.from_inputs(
            inputs, self.kv.block_size, pad_to=pad_to, trash_slot=self.kv.trash_slot,
            max_position=self.max_model_len - 1,
        )

    @staticmethod
    def _as_tree(inp: SeqInput, parents: list[int], window: int | None = None) -> None:
        """Make ``inp`` (the pending token, then the drafts) a tree's verification: node i at
        rotary position start + its depth, attending to the context and its ancestors (those
        within the target's sliding ``window``, as plain decoding sees them); its K/V still
        goes to slot start + i (``_compact_trees`` moves the accepted path)."""
        nodes = [-1] + [p + 1 for p in parents]  # the root is node 0
        inp.positions = [inp.start_pos + d for d in tree_depths(nodes)]
        inp.tree_base = inp.start_pos
        inp.tree_masks = tree_attention_masks(nodes, window=window)

    def _compact_trees(self, scheduled: list[ScheduledSeq]) -> None:
        """Move each verified tree's accepted path from its nodes' slots to the positions
        that follow its root (start + 1, start + 2, ...) in the target's layers, before
        anything reads them: one gather and one copy on the device for the whole step."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.kv.block_size
        for s in scheduled:
            v = s.verified
            if v is None or v.failure is not None or not v.path:
                continue
            table, root = s.seq.block_table, s.seq.num_computed  # not committed yet: the root's position
            for k, i in enumerate(v.path):
                if i != k:  # node i sits at root + 1 + i; it becomes the token at root + 1 + k
                    src.append(table[(root + 1 + i) // bs] * bs + (root + 1 + i) % bs)
                    dst.append(table[(root + 1 + k) // bs] * bs + (root + 1 + k) % bs)
        if src:
            idx = torch.tensor([src, dst], dtype=torch.int64).to(self.kv.data.device, non_blocking=True)
            self.kv.move(idx[0], idx[1], self.target.arch.num_layers)

    @staticmethod
    def _may_draft_tree(seq: Sequence) -> bool:
        """Trees are verified without logits controls: a request with a grammar, logprobs,
        penalties, logit_bias or min_tokens drafts chains."""
        p = seq.params
        return p.logprobs is None and not p.has_logits_processors

    @staticmethod
    def _hidden_rows(s: ScheduledSeq, start: int, committed: int):
        """The forward's rows of the tokens ``s`` committed: after a tree, its root and the
        accepted path's nodes (wherever they sat in the step)."""
        v = s.verified
        if v is not None and v.path is not None:
            return [start] + [start + 1 + i for i in v.path]
        return range(start, start + committed)

    def _prompt_logprob_rows(self, scheduled: list[ScheduledSeq], batch: StepBatch) -> list[tuple]:
        """Requests with prompt_logprobs: logits rows for the prompt positions of this chunk,
        appended AFTER every other row (row_offsets and the sampled rows stay as they are).
        Returns (state, first extra row, next prompt tokens) per such request."""
        jobs = []
        for b, s in enumerate(scheduled):
            st = self.requests.get(s.seq.request_id)
            if st is None or st.prompt_lps is None:
                continue
            seq, n0 = s.seq, s.seq.num_computed
            # position p's logits give the log-probability of prompt token p + 1
            ps = [p for p in range(n0, n0 + s.num_new_tokens) if len(st.prompt_lps) <= p + 1 < seq.num_prompt_tokens]
            if not ps:
                continue
            first = len(batch.logits_rows)
            batch.logits_rows.extend(batch.query_start[b] + p - n0 for p in ps)
            jobs.append((st, first, [seq.prompt_token_ids[p + 1] for p in ps]))
        return jobs

    def _prompt_logprobs(self, jobs: list[tuple], fwd) -> None:
        from specserve.engine.step_controls import prompt_logprob_lists

        for st, first, nxt in jobs:
            rows = list(range(first, first + len(nxt)))
            st.prompt_lps.extend(prompt_logprob_lists(fwd.logits, rows, nxt, st.seq.params.prompt_logprobs))

    @property
    def grammar_backend(self):
        """llguidance over the target's tokenizer, and the compiled-grammar cache (the
        tokenizer's conversion, about a second, happens at the first compile)."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                from specserve.structured import GrammarBackend

                self._grammar_backend = GrammarBackend(self.tokenizer.hf, self.target.arch.vocab_size,
                                                       tuple(self.tokenizer.eos_token_ids),
                                                       self.cfg.server.grammar_cache_entries)  # fmt: skip
            return self._grammar_backend

    def _grammar_state(self, params: SamplingParams):
        """The request's own matcher: a copy of the grammar the server compiled off this
        thread (``params.compiled_grammar``), else compiled here through the cache (offline)."""
        from specserve.structured import grammar_field

        so = params.structured_outputs
        compiled = params.compiled_grammar
        if compiled is None:
            compiled = self.grammar_backend.compile(so, self.cfg.server.grammar_max_chars, params.cache_salt)
        return compiled.new_state(grammar_field(so))

    def _propose_next(self, scheduled: list[ScheduledSeq], batch: StepBatch, fwd) -> bool:
        """Drafts for the next step, proposed now that this step is verified; a
        proposer conditioned on the target reads this forward's states by row.
        Returns whether anything was asked of the proposer."""
        forced = (grammar_drafts(self.requests, scheduled, self.num_spec_tokens, self.max_model_len)
                  if self.cfg.engine.grammar_drafts else set())  # fmt: skip
        if self.proposer is None and self.predictions is None:
            return False
        # A request with speculation off (its own num_speculative_tokens 0) is never handed to
        # the proposer nor counted by the controller: it costs what plain decoding costs.
        live = [(b, s) for b, s in enumerate(scheduled)
                if not s.seq.finished and s.seq.params.num_speculative_tokens != 0]
        num_sampled = sum(1 for _, s in live if s.sample)
        choice = self.spec_control.choose(num_sampled)
        num_drafts = int(choice)
        cut = self.cfg.engine.draft_confidence_threshold
        if cut == "auto":  # derived from the measured costs and acceptance
            cut = self.spec_control.draft_cut(num_sampled)
        reqs: list[DraftRequest] = []
        for b, s in live:
            seq = s.seq
            committed = s.num_new_tokens + (s.verified.num_accepted if s.verified is not None else 0)
            cap = seq.params.num_speculative_tokens  # the request's own bound on K (None: none)
            room = min(num_drafts, num_drafts if cap is None else cap,
                       self.max_model_len - len(seq.token_ids) - 1) if s.sample and seq.request_id not in forced else 0
            start = batch.query_start[b]
            reqs.append(DraftRequest(seq, max(room, 0), self._hidden_rows(s, start, committed),
                                     tree=choice.tree and self._may_draft_tree(seq), tree_depth=choice.depth or None,
                                     min_confidence=cut))
        if not reqs:
            return False
        if self.predictions is not None:
            prop, from_prediction = self.predictions.propose(reqs, fwd, self.proposer, self.num_spec_tokens)
        else:
            prop, from_prediction = self.proposer.propose(reqs, fwd), [0] * len(reqs)
        for i, (r, toks, n_pred) in enumerate(zip(reqs, prop.token_ids, from_prediction)):
            if r.max_drafts > 0:
                parents = prop.parents[i] if prop.parents is not None else None  # a tree's structure
                self.requests[r.seq.request_id].drafts = Drafts(
                    list(toks[: r.max_drafts]), prop.probs[i] if prop.probs is not None else None, n_pred,
                    parents[: r.max_drafts] if parents is not None else None, choice.depth)
        return True

    def _verify(self, scheduled: list[ScheduledSeq], fwd) -> None:
        """Verify every sampled entry of the step: each gets its ``Verified`` (the tokens it
        emits, or the failure of that request alone).  A batch that fails is verified
        request by request to find whose it was."""
        todo: list[tuple[ScheduledSeq, int, tuple[float, int, float, float]]] = []
        for b, s in enumerate(scheduled):
            if not s.sample:
                continue
            try:
                todo.append((s, fwd.row_offsets[b], self._sampling_row(s.seq.params)))
            except Exception as e:
                s.verified = Verified.failed("building its sampling tensors", e)
        if not todo:
            return
        try:
            self._verify_batch(todo, fwd)
            if self.speech is not None:  # +method=ctc: the first verification of a hypothesis
                eos = self.tokenizer.eos_token_ids[0] if self.tokenizer.eos_token_ids else None
                for s, row, _ in todo:
                    self.speech.review_first_pass(s, fwd.logits, row, eos)
        except Exception:
            log.exception("verification of a batch failed; verifying its requests one by one")
            for one in todo:
                try:
                    self._verify_batch([one], fwd)
                except Exception as e:
                    one[0].verified = Verified.failed("sampling", e)

    @staticmethod
    def _sampling_row(p: SamplingParams) -> tuple[float, int, float, float]:
        """One request's sampling parameters as the numbers the sampler tensors hold."""
        return float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p)

    def _verify_batch(self, todo: list[tuple[ScheduledSeq, int, tuple[float, int, float, float]]], fwd) -> None:
        """Sample/verify the entries ``todo`` (each with its first logits row and sampling
        row) on the device (``DeviceSampler``): one copy of their inputs up, one packed
        (B, K+2) result back.  Random numbers are keyed by (request seed, output position,
        purpose), so a seeded request's tokens do not depend on its neighbours, on K or on
        adaptive speculation."""
        if any(s.drafts.parents is not None for s, _, _ in todo):
            self._verify_trees([t for t in todo if t[0].drafts.parents is not None], fwd)
            todo = [t for t in todo if t[0].drafts.parents is None]
            if not todo:
                return
        entries = [s for s, _, _ in todo]
        rows = [row for _, row, _ in todo]
        temps, top_ks, top_ps, min_ps = zip(*(params for _, _, params in todo))
        seqs = [s.seq for s in entries]
        # Penalties, logit_bias, min_tokens and grammar masks at every verified position
        # (drafts a grammar refuses are cut: they could not be accepted).
        plan, drafts = plan_step(seqs, [self.requests[s.request_id].grammar for s in seqs],
                                 [s.drafts.token_ids for s in entries], rows, self.target.arch.vocab_size,
                                 tuple(self.tokenizer.eos_token_ids))  # fmt: skip
        logits = fwd.logits if plan is None else plan.apply(fwd.logits)
        inputs = self.sampler.prepare(
            rows, drafts, temps, top_ks, top_ps, min_ps, [s.seed for s in seqs], [s.num_output_tokens for s in seqs],
        )
        packed = self.sampler.sample(logits, inputs, *self._draft_probs(entries, drafts))
        want = [s.params.logprobs for s in seqs]
        if all(k is None for k in want):
            results = [Verified(toks, a) for toks, a in self.sampler.fetch(packed, len(entries))]
        else:  # the log-probabilities ride on the same copy back
            K1 = packed.shape[1] - 1
            top = max(k for k in want if k is not None)
            cols = logprob_columns(logits, inputs.row_index, packed[:, :K1], top)
            host = self.sampler.copy_to_host(torch.cat([packed, cols], dim=1))[: len(entries)].numpy()
            emitted = unpack(host[:, : K1 + 1].tolist())
            lps = logprob_lists(host[:, K1 + 1 :], [toks for toks, _ in emitted], want, K1, top)
            results = [Verified(toks, a, lp) for (toks, a), lp in zip(emitted, lps)]
        for s, v in zip(entries, results):
            s.verified = v

    def _verify_trees(self, todo: list[tuple[ScheduledSeq, int, tuple[float, int, float, float]]], fwd) -> None:
        """Verify the entries whose drafts are a tree (``sampling.tree``): greedy and strict
        rows emit plain decoding's tokens, the other methods verify the siblings as
        multiple drafts (target-only: a tree's drafts carry no q).  One packed result back;
        a step of greedy trees copies back each node's argmax and walks them on the host."""
        entries = [s for s, _, _ in todo]
        seqs = [s.seq for s in entries]
        drafts = [s.drafts.token_ids for s in entries]
        temps, top_ks, top_ps, min_ps = zip(*(params for _, _, params in todo))
        if all(t < GREEDY_EPS for t in temps):  # every node's argmax, one copy, the walk on the host
            host = self.sampler.copy_to_host(node_argmax(fwd.logits, [row for _, row, _ in todo], drafts))
            paths = greedy_tree_paths(host.tolist(), drafts, [s.drafts.parents for s in entries])
            for s, (toks, a, path) in zip(entries, paths):
                s.verified = Verified(toks, a, path=path)
            return
        dev = self.target.device
        trees = tree_inputs([row for _, row, _ in todo], drafts, [s.drafts.parents for s in entries], dev)
        req = RequestTensors.build(temps, top_ks, top_ps, min_ps, [s.seed for s in seqs],
                                   [s.num_output_tokens for s in seqs], dev)
        method = "strict" if self.sampler.method == "strict" else "probabilistic"
        packed = verify_trees(fwd.logits, trees, req, method=method)
        host = self.sampler.copy_to_host(packed)
        for s, (toks, a, path) in zip(entries, unpack_trees(host, drafts)):
            s.verified = Verified(toks, a, path=path)

    def _draft_probs(self, entries: list[ScheduledSeq], drafts: list[list[int]]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For verification that reads q (probabilistic, block): (B, K, V) q of each request's drafts where the
        proposer sampled them from a distribution, and (B,) which rows have one (the
        others, argmax or copied drafts, are verified strictly); (None, None) when no
        request has any."""
        qs = [s.drafts.probs for s in entries]
        has_q = [q is not None and bool(d) for q, d in zip(qs, drafts)]
        if self.sampler.method not in Q_VERIFICATION_METHODS or not any(has_q):
            return None, None
        out = torch.zeros(len(entries), self.sampler.num_spec_tokens, self.target.arch.vocab_size,
                          device=self.target.device)
        for b, (q, d) in enumerate(zip(qs, drafts)):
            if has_q[b]:
                out[b, : len(d)] = q[: len(d)]
        return out, torch.tensor(has_q, device=self.target.device)

    def _commit(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        req_stats: list[RequestStepStats] = []
        n_prompt = n_gen = 0
        for s in scheduled:
            seq = s.seq
            st = self.requests[seq.request_id]
            before = len(seq.token_ids)
            n_prompt += max(0, min(seq.num_computed + s.num_new_tokens, seq.num_prompt_tokens) - seq.num_computed)
            if not s.sample:
                self.scheduler.commit(seq, seq.num_computed + s.num_new_tokens)
                continue
            v = s.verified
            if v.failure is not None:
                outputs.append(self._fail_request(st, v.stage, v.failure))
                continue
            d, a = s.drafts.token_ids, v.num_accepted
            if d:
                seq.spec_stats.num_drafts += 1
                seq.spec_stats.num_draft_tokens += len(d)
                seq.spec_stats.num_accepted_tokens += a
                if not s.drafts.num_forced:  # the method's drafts (forced ones say nothing of it)
                    self.spec_control.observe_drafts(len(d), a, tree=s.drafts.parents is not None, depth=s.drafts.depth)
            n_pred = s.drafts.num_from_prediction  # leading drafts from the request's prediction
            stage = "updating its draft state"
            try:
                if self.proposer is not None:  # drafts from a prediction are none of the method's
                    mine = not (n_pred or s.drafts.num_forced)
                    self.proposer.on_verified(seq, before, len(d) if mine else 0, a if mine else 0)
                # K/V is valid for the fed tokens up to the pending one plus accepted drafts.
                self.scheduler.commit(seq, seq.num_computed + s.num_new_tokens + a)
                stage = "matching its stop tokens"
                new_ids, reason = self._append_tokens(seq, v.tokens)
                if st.grammar is not None:  # a grammar that cannot take these tokens fails the request
                    stage = "advancing its grammar"
                    st.grammar.advance(new_ids)
                if n_pred:  # OpenAI's counts: prediction tokens that made it into the output, and the rest
                    kept = min(a, n_pred, len(new_ids))
                    seq.spec_stats.num_accepted_prediction_tokens += kept
                    seq.spec_stats.num_rejected_prediction_tokens += n_pred - kept
                if reason is not None:
                    self._finish(st, reason)
                out = self._output(st, new_ids)
                if v.logprobs is not None:
                    out.new_logprobs = v.logprobs[: len(new_ids)]
                if st.proc is not None:
                    stage = "detokenizing its output"
                    out, stop = st.proc.process(out)
                    if stop:  # a stop string: finish it with the output just built
                        self._finish(st, FinishReason.STOP)
            except Exception as e:
                outputs.append(self._fail_request(st, stage, e))
                continue
            ttft = itl = None
            if new_ids:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    ttft = now - seq.arrival_time
                else:
                    itl = (now - (seq.last_token_time or now)) / len(new_ids)
                seq.last_token_time = now
            n_gen += len(new_ids)
            req_stats.append(
                RequestStepStats(
                    request_id=seq.request_id, num_new_tokens=len(new_ids), num_draft_tokens=len(d),
                    num_accepted_tokens=a, accepted_per_position=[i < a for i in range(len(d))],
                    time_to_first_token_s=ttft, inter_token_latency_s=itl,
                )
            )
            outputs.append(out)
        self._emit_step(StepStats(
            num_running=self.num_running, num_waiting=self.num_waiting, kv_cache_usage=self.blocks.usage,
            num_prompt_tokens=n_prompt, num_generation_tokens=n_gen, requests=req_stats,
            num_speculative_tokens=self.spec_control.num_drafts if self.num_spec_tokens else 0,
            draft_trees=self.spec_control.tree and self.spec_control.num_drafts > 0,
            **self._prefix_cache_deltas(), **self._suffix_cache_usage(),
        ))
        return outputs

    def _encode_audio(self) -> list[RequestOutput]:
        """The encoder's work of this step (``engine.speech``): encoded requests join the
        scheduler with their hypothesis as first drafts, or are settled by it (relaxed
        mode's entropy gate); returns the outputs of those that end here."""
        outputs: list[RequestOutput] = []
        for st, hyp, failure in self.speech.encoded(self.scheduler.foreground_present()):
            if failure is not None:
                outputs.append(self._fail_request(st, "encoding its recording", failure))
                continue
            seq = st.seq
            if hyp is not None and hyp.settled:  # the CTC text is the answer: no LLM forward
                try:
                    seq.spec_stats.ctc_stage = "entropy"
                    eos = list(self.tokenizer.eos_token_ids[:1])
                    new_ids, reason = self._append_tokens(seq, hyp.token_ids + eos)
                    self._finish(st, reason or FinishReason.STOP)
                    out = self._output(st, new_ids)
                    if st.proc is not None:
                        out = st.proc.process(out)[0]
                    outputs.append(out)
                except Exception as e:
                    outputs.append(self._fail_request(st, "settling its CTC transcript", e))
                continue
            st.drafts = Drafts(self.speech.first_drafts(seq))
            self.scheduler.add(seq)
        return outputs

    def _append_tokens(self, seq: Sequence, toks: list[int]) -> tuple[list[int], FinishReason | None]:
        p = seq.params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(self.tokenizer.eos_token_ids)
        new: list[int] = []
        for t in toks:
            seq.token_ids.append(t)
            new.append(t)
            if t in stops:
                return new, FinishReason.STOP
            if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                return new, FinishReason.LENGTH
        return new, None

    def _finish(self, st: RequestState, reason: FinishReason) -> None:
        """End a request (stop, length, abort or its own failure): the one teardown, then its stats."""
        seq = st.seq
        if seq.finished:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.requests.release(st, finished=True)
        fin = RequestFinishedStats(
            request_id=seq.request_id, finish_reason=reason.value, num_prompt_tokens=seq.num_prompt_tokens,
            num_generation_tokens=seq.num_output_tokens, e2e_latency_s=time.monotonic() - seq.arrival_time,
            num_drafts=seq.spec_stats.num_drafts, num_draft_tokens=seq.spec_stats.num_draft_tokens,
            num_accepted_tokens=seq.spec_stats.num_accepted_tokens, ctc_stage=seq.spec_stats.ctc_stage,
        )
        for listener in self.listeners:
            listener.on_request_finished(fin)

    def _output(self, st: RequestState, new_ids: list[int]) -> RequestOutput:
        """A token delta; text and the output so far are filled by an OutputProcessor."""
        seq = st.seq
        out = RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text="", token_ids=[],
            text="", finished=seq.finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            spec=dataclasses.replace(seq.spec_stats),
        )
        if st.prompt_lps is not None and not st.prompt_lps_sent and (new_ids or seq.finished):
            st.prompt_lps_sent = True  # echo: the prompt's log-probabilities, once
            out.prompt_logprobs = st.prompt_lps
            out.prompt_token_ids = seq.prompt_token_ids
        return out

    def _prefix_cache_deltas(self) -> dict[str, int]:
        q, h = self.blocks.num_queried_tokens, self.blocks.num_hit_tokens
        dq, dh = q - self._prefix_reported[0], h - self._prefix_reported[1]
        self._prefix_reported = (q, h)
        return {"prefix_cache_queries": dq, "prefix_cache_hits": dh}

    def _suffix_cache_usage(self) -> dict[str, int]:
        """The size of suffix decoding's global response cache (proposers with ``cache_usage``)."""
        usage = getattr(self.proposer, "cache_usage", None)
        if usage is None:
            return {}
        nbytes, responses = usage()
        return {"suffix_cache_bytes": nbytes, "suffix_cache_responses": responses}

    def _emit_step(self, stats: StepStats) -> None:
        for listener in self.listeners:
            listener.on_step(stats)

    # ------------------------------------------------------------ offline
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params):
            self.add_request(rid, p, sp)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]
