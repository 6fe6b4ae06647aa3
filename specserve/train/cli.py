"""``specserve-train [--config-name train/<preset>] [override ...]``: train an EAGLE-3 head, or
with a speech preset (``train/smollm2-135m-speech``) a speech encoder and projector.

The default preset is ``train/smollm2-135m-eagle3`` (the head shipped for the
embedded model).  Overrides are Hydra overrides of ``specserve.train.config``
(``model.path=... data.num_conversations=... optim.epochs=... output_dir=...``).
Bad keys or values print one line and exit 2, like ``specserve``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from specserve.errors import SpecServeError

DEFAULT_PRESET = "train/smollm2-135m-eagle3"

USAGE = """usage: specserve-train [--config-dir DIR] [--config-name train/PRESET] [--cfg] [-h] [OVERRIDE ...]

Trains an EAGLE-3 draft head for the target model: generates the training data with
the target, trains, evaluates the head's acceptance and exports it (speculators
format) to output_dir.  The default preset, train/smollm2-135m-eagle3, trains the
head shipped for the embedded model.  For example:
  specserve-train data.num_conversations=200 optim.epochs=1 output_dir=outputs/my-head
  specserve-train model.path=/models/my-llama output_dir=outputs/my-llama-eagle3

Keys (the defaults of the schema; a preset may set others, see --cfg):
{keys}
The target is model.* and the engine that generates the data engine.*, as for
`specserve` (model.dtype defaults to float32 here).  --cfg prints the composed
config and exits.
"""


def help_text() -> str:
    """What ``specserve-train --help`` prints: its usage and keys."""
    from specserve.compose import keys_help
    from specserve.train.config import TrainConfig

    return USAGE.replace("{keys}", "\n".join(keys_help("", TrainConfig, skip=("model", "engine"))))


def compose_train_config(argv: list[str]):
    from specserve.compose import UsageError, _parse_argv, compose_object
    from specserve.train.config import TrainConfig, register_train_configs, validate_train_config
    from specserve.train.speech_config import SpeechTrainConfig, register_speech_configs, validate_speech_config

    extra_dir, name, show, help_, overrides = _parse_argv(argv)
    if help_:
        print(help_text())
        return None
    if name == "config":  # _parse_argv's default is the server's config
        name = DEFAULT_PRESET
    obj = compose_object(name, overrides, extra_dir, show,
                         lambda cs: (register_train_configs(cs), register_speech_configs(cs)))
    if obj is None:
        return None
    if isinstance(obj, SpeechTrainConfig):  # a speech model's preset (train/*-speech.yaml)
        return validate_speech_config(obj)
    if not isinstance(obj, TrainConfig):
        raise UsageError(f"--config-name {name}: not a training preset (conf/train/*.yaml)")
    return validate_train_config(obj)


def main(argv: list[str] | None = None) -> int:
    from specserve.compose import UsageError, _cap_onednn_isa

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = compose_train_config(argv)
        if cfg is None:
            return 0
        from specserve.train.speech_config import SpeechTrainConfig

        if isinstance(cfg, SpeechTrainConfig):
            from specserve.train.speech import train_speech

            report = train_speech(cfg)
        else:
            _cap_onednn_isa(cfg)
            from specserve.train.trainer import train

            report = train(cfg)
    except (UsageError, SpecServeError) as e:
        print(f"specserve-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
