"""Is a rank's main thread blocked in torch.distributed? Then, once another rank has failed, it
cannot answer on its own, and waiting out the failure grace (reports.FAILURE_GRACE) is useless.

Blocked: at two looks (a watchdog's, 0.1 s apart) the thread is at the same instruction of the
same frame, a frame of a torch.distributed function: it is inside a C call there (a collective,
a barrier, a store wait). A thread running Python moves between looks. Used by the launcher's
watchdog (pytest_linattn.ranks.launcher_watchdog) and by pool ranks (pytest_linattn.ranks.worker).
"""
from __future__ import annotations

import os
import sys

__all__ = ["BlockedLook"]

_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"


class BlockedLook:
    """Looks at one thread (by its ident); `look()` says where it is blocked, or None."""

    def __init__(self, ident: int):
        self.ident = ident
        self._at = None

    def look(self) -> str | None:
        """The torch.distributed function whose C call the thread has been in since the last
        look; None when it moved, or is elsewhere."""
        frame = sys._current_frames().get(self.ident)
        at = None if frame is None else (id(frame), frame.f_lasti, frame.f_code)
        before, self._at = self._at, at
        if at is None or at != before or _TORCH_DISTRIBUTED not in frame.f_code.co_filename:
            return None
        return frame.f_code.co_name

    def forget(self) -> None:
        """The thread left the call being watched: the next look starts afresh."""
        self._at = None
