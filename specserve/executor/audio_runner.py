"""The speech encoder's runner (data plane): one recording -> its audio rows and CTC posteriors.

``encode`` computes the log-mel features (``audio.features``), runs the encoder and the
projector of the loaded ``SpeechModel`` once, and returns the projector's outputs (the
prompt's audio rows, on the model's device, in the text model's dtype) and the CTC log
posteriors of the final encoder states (float32, on the host: the CTC method reads them).
``cost`` is what one recording weighs against the engine's per-step encoder budget:
its encoder frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specserve.audio.features import input_features, num_audio_tokens, num_encoder_frames
from specserve.executor.models.granite_speech import SpeechSpec


@dataclass
class AudioEncoding:
    embeds: Tensor  # (audio tokens, H): the prompt's audio rows
    ctc_log_probs: Tensor  # (frames, labels) float32 on the host


class AudioEncoderRunner:
    def __init__(self, spec: SpeechSpec, text_dtype: torch.dtype):
        if spec.model is None:
            raise ValueError("the speech model's encoder and projector are not loaded")
        self.spec = spec
        self.model = spec.model
        self.text_dtype = text_dtype
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def num_audio_tokens(self, num_samples: int) -> int:
        return num_audio_tokens(num_samples, self.spec.window_size, self.spec.downsample_rate)

    @staticmethod
    def cost(num_samples: int) -> int:
        return num_encoder_frames(num_samples)

    @torch.inference_mode()
    def encode(self, samples: np.ndarray) -> AudioEncoding:
        feats = input_features(samples).to(device=self.device, dtype=self.dtype)
        embeds, logp = self.model.audio_embeddings(feats)
        return AudioEncoding(embeds.to(self.text_dtype), logp.float().cpu())
