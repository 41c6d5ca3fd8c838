"""torchrun (`python -m torch.distributed.run`, same arguments), ended without the interpreter's teardown once its
group has succeeded.

Every data-parallel group (trainer/rank_group.py) and every other node's part (trainer/node_parts.py) runs its ranks
under torchrun, and a group's `close` waits for torchrun to exit. After its workers have finished, torchrun's own
Python spent about a CPU-second and, on a loaded 2-core machine, 4 to 7 s of wall tearing down torch's modules
(docs/hardware.md, "The suite's time"): nothing is left to write then, so it ends at once. A failure (torchrun's
ChildFailedError, a signal) raises as before: the summary, the error file and the exit code are torchrun's own.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
