"""The lifetime shared by the EP ops (``EPBuffer``, ``PrefillBuffer``): symmetric buffers allocated by the
first call, one dispatch and one combine (``PhasedOp`` + ``Channel`` each), closed together."""

from __future__ import annotations

from .errors import ClosedError


class OpBuffer:
    """Subclasses set ``_closed = _allocated = False`` and implement ``_allocate()``, which builds
    ``_dispatch_op``, ``_combine_op``, ``_dispatch_ch`` and ``_combine_ch`` and sets ``_allocated``."""

    def close(self) -> None:
        """Free the symmetric buffers (collective). Any later call raises ClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._allocated:
            self._dispatch_op.mark_closed()
            self._combine_op.mark_closed()
            if not self.group.closed:
                self._combine_ch.free()
                self._dispatch_ch.free()

    def _ensure_allocated(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__}: used after close()")
        self.group.ensure_open()
        if not self._allocated:
            self._allocate()
