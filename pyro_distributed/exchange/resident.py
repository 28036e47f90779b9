"""Bucket buffers that outlive a step, with gradients as views into them.

A bucket packed into a new tensor each step needs a new view per member
each step as well, to point the member's ``.grad`` at its average; on
hundreds of small parameters those views were most of the exchange's own
time. A :class:`ResidentBuffer` is made once per bucket, with one view per
member: a step copies the gradients in (one call into C++), the engine
sums in place, and each ``.grad`` is pointed at the view it had last step.
DDP's ``gradient_as_bucket_view`` keeps its buckets the same way. The
values are the same as a new tensor's would be, so the averages are
bitwise equal.

:meth:`ResidentBuffer.pack` declines, and the bucket is packed into a new
tensor instead (:meth:`~.layout.Bucket.pack`), when:

* a member has no gradient, or a sparse one (the new tensor writes zeros);
* the gradients do not fill the bucket (a parameter resized in place: the
  new tensor's pack names it);
* a member's ``.grad`` *is* its view in this buffer: a loop that zeroes
  gradients in place (``zero_grad(set_to_none=False)``) keeps last step's
  views, so backward adds into the buffer, and a buffer still on the wire
  while another backward pass adds into it would mix the two.

The buffer is what the front end's ``.grad`` holds until its loop replaces
or zeroes it, and the next step writes into it: a reference to a ``.grad``
kept past the next step sees the next step's values, as under DDP's
``gradient_as_bucket_view=True``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from ..torch_internals import copy_all_, unflatten_dense
from .layout import Bucket


class ResidentBuffer:
    """One bucket's flat buffer, kept from step to step, and its members' views.

    :param bucket: the bucket's layout.
    :param members: the bucket's tensors, in its order.
    :param riders: how many riders it carries (the buffer's length depends on it).
    """

    def __init__(self, bucket: Bucket, members: Sequence[Tensor], riders: int) -> None:
        self.riders = riders
        self._members = tuple(members)
        self._size = bucket.size
        flags = len(members) + bucket.norm_slot
        self.buffer = torch.zeros(
            bucket.size + flags + riders, dtype=bucket.dtype, device=bucket.device
        )
        #: Per member, its gradient's place in the buffer, shaped like the member.
        self.views = unflatten_dense(self.buffer, list(members))
        tail = self.buffer[bucket.size :]
        self._targets = [*self.views, tail[:flags], tail[flags:]]

    def pack(self, flags: Tensor, riders: Tensor | None) -> Tensor | None:
        """The gradients, then ``flags`` (presence and norm slot) and ``riders``,
        copied into the buffer; ``None`` where it cannot be used (module docstring)."""
        grads = [member.grad for member in self._members]
        if any(map(operator.is_, grads, self.views)):
            return None
        sources = [*grads, flags]
        targets = self._targets if riders is not None else self._targets[:-1]
        if riders is not None:
            sources.append(riders)
        try:
            # A copy broadcasts: a gradient smaller than its view (a parameter
            # shrunk in place) would fill it silently. The total says so, and
            # the new tensor's pack raises naming it.
            if sum(map(Tensor.numel, grads)) != self._size:  # type: ignore[arg-type]
                return None
            # Without a graph: a gradient made with create_graph=True carries one.
            with torch.no_grad():
                copy_all_(targets, sources)  # type: ignore[arg-type]
        except (TypeError, RuntimeError):  # a gradient is None, or sparse
            return None
        return self.buffer
