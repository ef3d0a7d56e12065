"""What the server reads of the model's folder beside the weights the engine loads: the
tokenizer the routes use (with `--chat-template`'s template in place of its own) and what a
request's unset sampling fields mean (`--sampling-defaults`)."""

from __future__ import annotations

import logging
from typing import Any

from eagleserve.config import ServerArgs
from eagleserve.server.chat_template import read_chat_template, with_chat_template
from eagleserve.server.sampling_defaults import SamplingDefaults, read_sampling_defaults

logger = logging.getLogger("eagleserve.server")


def serving_files(
    args: ServerArgs, model_path: str, tokenizer: Any
) -> tuple[Any, SamplingDefaults]:
    """(the routes' tokenizer, the sampling defaults); ValueError or OSError saying what is
    wrong with the template or the model's generation_config.json."""
    defaults = read_sampling_defaults(model_path, args.sampling_defaults)
    changed = defaults.changed()
    if changed:
        logger.info("sampling defaults from the model's generation_config.json: %s", changed)
    if args.chat_template is not None:
        tokenizer = with_chat_template(tokenizer, read_chat_template(args.chat_template))
    return tokenizer, defaults
