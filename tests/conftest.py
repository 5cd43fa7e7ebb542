"""Configuration of the cross-package tests: they may import ``tools`` (the command line).

Only these tests put the repository root on ``sys.path``; the members' own tests do not, so
they stay runnable with nothing but their member's dependencies.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
