"""`detllm locate`: from the first step where two runs differ to the first layer and op where their
bits part. Re-runs each side's recorded batch through its backend's capture capability
(`backends.base.Backend.capture`), checks it reproduces its own trace, aligns the captured modules
and names the first op whose inputs agree but whose output differs; then grafts it into the other
side's re-run to test whether it is the cause (graft.py) and says benign or bug (category.py).
See docs/locate.md.
"""

from .core import locate
from .folder import LOCATE, Located

__all__ = ["LOCATE", "Located", "locate"]
