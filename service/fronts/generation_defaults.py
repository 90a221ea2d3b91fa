"""The sampling defaults a model brings: its bundle's `generation_config.json`, as vLLM reads it.

A field the request leaves unset takes the model's value when the model's generation config states
one: `do_sample: false` makes the default greedy (temperature 0), and `temperature`, `top_k`, `top_p`,
`min_p` and `repetition_penalty` are taken as they are written. A key the file does not write leaves
the API's own default (temperature 1 and no truncation). A value out of the API's range is left out,
with a warning, rather than refusing every request that relies on it. numpy-free, torch-free.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import ValidationError

from service.engine.request import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def sampling_defaults(bundle_dir: str | Path) -> dict:
    """The SamplingParams fields the bundle's generation config sets ({} without one)."""
    path = Path(bundle_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s): the API's sampling defaults apply", path, e)
        return {}
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    defaults = {}
    for key in KEYS:
        if key in config and config[key] is not None:
            try:
                SamplingParams(**{key: config[key]})
            except ValidationError:
                log.warning("%s: %s=%r is outside the API's range; the API's default applies", path, key, config[key])
                continue
            defaults[key] = config[key]
    return defaults
