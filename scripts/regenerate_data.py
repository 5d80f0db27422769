#!/usr/bin/env python
"""Regenerate training conversations with the target itself, or pack them into ``data/`` (``train/regen/cli.py``).

The draft must learn the target's distribution, so every assistant turn is written by the target, given the
regenerated history. The work is done by the :mod:`train.regen` package: prompt sources (:mod:`train.regen.sources`,
:mod:`train.regen.grounded`, :mod:`train.regen.magpie`), the batching scheduler over the engine's public API
(:mod:`train.regen.scheduler`), the resumable work folder (:mod:`train.regen.store`) and packing with its manifest
(:mod:`train.regen.pack`). Run with ``--help`` for the commands.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from train.regen.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
