"""OUT/training_log.json, the record every `train-draft` mode leaves beside the head."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence


def write_training_log(ns: argparse.Namespace, log: dict, summary: Sequence[str]) -> None:
    """Writes `log` and then, under "args", every flag of `ns` to OUT/training_log.json (OUT =
    ns.out), and prints the `summary` keys of the log as one JSON line."""
    log = {**log, "args": {k: v for k, v in vars(ns).items() if k != "func"}}
    with open(os.path.join(ns.out, "training_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    print(json.dumps({k: log[k] for k in summary}))
