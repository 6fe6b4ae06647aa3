"""The schema of ``specserve-train --config-name train/<speech preset>``: training a speech
encoder (character CTC) and a projector for a frozen text model, in the Granite Speech
layout (``specserve.train.speech``).  No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from specserve.errors import ConfigError


@dataclass
class SpeechDataConfig:
    num_sentences: int = 8000  # training sentences (ShareGPT training pool, held-out fixtures excluded)
    num_valid: int = 64  # further sentences, spoken the same way, for the progress lines
    exclude_file: str = "tests/fixtures/speech/sentences.txt"  # held-out sentences (never trained on)
    voice: str = "en-us"
    wpm: list[int] = field(default_factory=lambda: [150, 200])  # words per minute, drawn per sentence
    pitch: list[int] = field(default_factory=lambda: [35, 65])
    noise_snr_db: list[float] = field(default_factory=lambda: [25.0, 60.0])  # white noise, drawn per batch item
    noise_prob: float = 0.5
    gain_db: list[float] = field(default_factory=lambda: [-6.0, 6.0])
    seed: int = 0
    # Everyday sentences written by the text model itself (``speech_text``), spoken the
    # same way, beside the ShareGPT ones (0: none); and their validation share.
    generated_sentences: int = 0
    generated_valid: int = 64
    # SpecAugment (stages with spec_augment: true): masks of whole mel bands (both frames
    # of a stacked pair) and of frame runs, each width drawn up to the maximum.
    freq_masks: int = 2
    freq_mask_bins: int = 10
    time_masks: int = 2
    time_mask_frames: int = 8


@dataclass
class SpeechEncoderConfig:
    num_layers: int = 4
    hidden_dim: int = 192
    num_heads: int = 4
    feedforward_mult: int = 4
    output_dim: int = 128  # CTC labels: Unicode code points 1..127 (ASCII), blank 0
    context_size: int = 200
    max_pos_emb: int = 512
    conv_kernel_size: int = 15
    conv_expansion_factor: int = 2
    dropout: float = 0.1


@dataclass
class SpeechProjectorConfig:
    hidden_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 768
    window_size: int = 15
    downsample_rate: int = 5


@dataclass
class SpeechStageConfig:
    max_steps: int = 2000
    max_minutes: float = 35.0  # the stage ends at whichever comes first; the lr schedule follows both
    lr: float = 1.5e-3
    warmup_steps: int = 100
    batch_size: int = 16
    checkpoint_every: int = 50
    generated: bool = True  # sample the generated sentences too (data.generated_sentences)
    spec_augment: bool = False


@dataclass
class SpeechJointStageConfig(SpeechStageConfig):
    """Stage ``joint``: the encoder's upper blocks trained beside the projector and the text
    model's adapter, on the LM loss plus ``ctc_weight`` times the CTC loss (the encoder runs
    each step; its lower blocks, and every batch norm's statistics, stay frozen)."""
    encoder_layers: int = 2  # the top conformer blocks trained (with the CTC head)
    ctc_weight: float = 1.0
    encoder_lr_mult: float = 1.0  # the encoder's learning rate: the stage's lr times this


@dataclass
class SpeechAdapterConfig:
    """The text model's low-rank adapter (stages ``adapt`` and ``joint``; rank 0: none, the
    text model stays as it is).  Shipped beside the encoder and merged into the text weights
    at load time."""
    rank: int = 0
    alpha: float = 32.0  # the factors' product is scaled by alpha / rank
    modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
    lr_mult: float = 1.0  # the adapter's learning rate: the stage's lr times this


@dataclass
class SpeechTrainConfig:
    model: Any = field(default_factory=lambda: {"name": "smollm2-135m-instruct",
                                                "path": "embedded:smollm2-135m-instruct"})
    data: SpeechDataConfig = field(default_factory=SpeechDataConfig)
    encoder: SpeechEncoderConfig = field(default_factory=SpeechEncoderConfig)
    projector: SpeechProjectorConfig = field(default_factory=SpeechProjectorConfig)
    ctc: SpeechStageConfig = field(default_factory=SpeechStageConfig)
    # The encoder trained on (a second learning-rate cycle, from ctc's weights; max_steps 0
    # skips it).
    ctc2: SpeechStageConfig = field(default_factory=lambda: SpeechStageConfig(
        max_steps=0, lr=1e-3, warmup_steps=50, spec_augment=True))
    # The projector's stages (``speech``): the filler vectors (LM loss on the transcripts'
    # own token embeddings), the projector regressed onto the token embeddings placed by a
    # CTC forced alignment (no text-model forward), then the LM loss through the frozen
    # text model.  max_steps 0 skips a stage.
    filler: SpeechStageConfig = field(default_factory=lambda: SpeechStageConfig(
        max_steps=60, max_minutes=15.0, lr=3e-3, warmup_steps=5, batch_size=8, checkpoint_every=10))
    embed: SpeechStageConfig = field(default_factory=lambda: SpeechStageConfig(
        max_steps=3000, max_minutes=30.0, lr=2e-3, warmup_steps=100, batch_size=32, checkpoint_every=250))
    align: SpeechStageConfig = field(default_factory=lambda: SpeechStageConfig(
        max_steps=300, max_minutes=40.0, lr=3e-4, warmup_steps=20, batch_size=8, checkpoint_every=25))
    # Stage adapt: the projector and the text model's adapter trained together with the LM
    # loss (after align; max_steps 0 or adapter.rank 0 skips it).
    adapt: SpeechStageConfig = field(default_factory=lambda: SpeechStageConfig(
        max_steps=0, max_minutes=60.0, lr=3e-4, warmup_steps=20, batch_size=8, checkpoint_every=25))
    # Stage joint: after adapt (max_steps 0 skips it; it needs adapter.rank > 0).
    joint: SpeechJointStageConfig = field(default_factory=lambda: SpeechJointStageConfig(
        max_steps=0, max_minutes=60.0, lr=3e-4, warmup_steps=20, batch_size=8, checkpoint_every=25))
    adapter: SpeechAdapterConfig = field(default_factory=SpeechAdapterConfig)
    # An exported speech model directory (config.json + model.safetensors, e.g. the
    # package's asset) whose encoder and projector stand in for stages ctc .. align: the
    # run builds its data and targets, then trains the later stages from there.
    init_from: Optional[str] = None
    # The audio placeholder's token id in the text model's vocabulary (a token plain text
    # never produces; SmolLM2's <empty_output>).
    audio_token_index: int = 16
    # The prompt the model is trained with (written to its config, used by every door):
    # a short system turn and no instruction keep training sequences short.
    prompt_system: Optional[str] = "Transcribe the audio."
    prompt_instruction: Optional[str] = ""
    num_threads: Optional[int] = 1
    cache_dir: Optional[str] = None  # model.cache_dir for the text model's conversion
    output_dir: str = "outputs/speech-smollm2-135m"  # checkpoints (resumable) and the exported model
    export_dir: Optional[str] = None  # also copy the exported model here (the package's asset)


def register_speech_configs(cs: Any) -> None:
    cs.store(name="specserve_train_speech_schema", node=SpeechTrainConfig)


def validate_speech_config(cfg: SpeechTrainConfig) -> SpeechTrainConfig:
    for key, value in (("data.num_sentences", cfg.data.num_sentences), ("encoder.num_layers", cfg.encoder.num_layers),
                       ("encoder.hidden_dim", cfg.encoder.hidden_dim), ("ctc.batch_size", cfg.ctc.batch_size),
                       ("align.batch_size", cfg.align.batch_size), ("projector.window_size", cfg.projector.window_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(key, f"must be an integer >= 1, got {value!r}")
    if isinstance(cfg.adapter.rank, bool) or not isinstance(cfg.adapter.rank, int) or cfg.adapter.rank < 0:
        raise ConfigError("adapter.rank", f"must be an integer >= 0, got {cfg.adapter.rank!r}")
    if cfg.adapter.rank and not cfg.adapter.modules:
        raise ConfigError("adapter.modules", "must name at least one linear layer (q_proj, v_proj, ...)")
    j = cfg.joint
    if j.max_steps > 0:
        if not cfg.adapter.rank:
            raise ConfigError("joint.max_steps", "stage joint trains the text model's adapter: set adapter.rank > 0")
        if isinstance(j.encoder_layers, bool) or not isinstance(j.encoder_layers, int) or not (
                0 <= j.encoder_layers <= cfg.encoder.num_layers):
            raise ConfigError("joint.encoder_layers", f"must be an integer in 0..encoder.num_layers "
                                                      f"({cfg.encoder.num_layers}), got {j.encoder_layers!r}")
        if not j.ctc_weight >= 0:
            raise ConfigError("joint.ctc_weight", f"must be >= 0, got {j.ctc_weight!r}")
    if cfg.init_from is not None and not (Path(cfg.init_from) / "config.json").is_file():
        raise ConfigError("init_from", f"{cfg.init_from} is not a speech model directory (no config.json)")
    if cfg.encoder.hidden_dim % cfg.encoder.num_heads:
        raise ConfigError("encoder.num_heads", f"must divide encoder.hidden_dim ({cfg.encoder.hidden_dim})")
    if cfg.projector.window_size % cfg.projector.downsample_rate:
        raise ConfigError("projector.downsample_rate", "must divide projector.window_size")
    if cfg.encoder.output_dim < 128:
        raise ConfigError("encoder.output_dim", "must be >= 128 (ASCII code points are the CTC labels)")
    return cfg
