"""Which tensors every method sends dense: the small ones, and a model's running statistics.

A small tensor (under ``min-compress-numel`` values: biases, norms' scales) goes dense because,
as in 3LC, compressing it costs more time than the bytes it saves.

A running statistic (BatchNorm's ``running_mean`` and ``running_var``, Keras's ``moving_mean``
and ``moving_variance``) goes dense whatever its size, because compressing it breaks the model.
This is fedcomp's departure; none of the five papers trains a model with such buffers. A
statistic is not trained by gradient. Each client overwrites it with an average of its own
batches, so a client's update of it is about ``-(R - S)``: the statistic ``S`` it measured, less
the replica value ``R`` it started from. Three ways compression then goes wrong:

- **Error feedback keeps the unsent part.** Client after client adds the same ``-(R - S)`` to
  its residual, and the sum overshoots once it is sent.
- **The downlink is lossy.** The server adds the update to its exact model ``W``, not to ``R``,
  so ``W + update`` carries the replica's error ``W - R`` at full size. The lattice's grid can be
  as coarse as twice the values' RMS, and a variance then goes negative.
- **Binarization or top-k** gives the channels someone else's value.

An audit found this with a BatchNorm CNN on Fashion-MNIST under the lattice downlink: a negative
``running_var``, then a NaN model. Sent dense, a statistic is averaged over the clients as
Flower's FedAvg averages it. The lattice puts it, like every small tensor, on a fine grid
(:func:`fedcomp.flower.replica.grid_exponents`).

Statistics are known by name, the last component of the array's key. This covers PyTorch's
``state_dict`` keys (``layer1.0.bn1.running_var``) and Keras's (``bn/moving_variance:0``). A
model whose statistics have other names should keep them under ``min-compress-numel`` values, or
rename them.
"""

from __future__ import annotations

import re

__all__ = ["STATISTIC_NAMES", "is_statistic", "sent_dense"]

#: The last name component of a running statistic.
STATISTIC_NAMES = ("running_mean", "running_var", "moving_mean", "moving_variance")

_STATISTIC = re.compile(r"(?:^|[./])(?:" + "|".join(STATISTIC_NAMES) + r")(?::\d+)?$")


def is_statistic(name: str) -> bool:
    """Whether the array named ``name`` is a running statistic (:data:`STATISTIC_NAMES`)."""
    return _STATISTIC.search(name) is not None


def sent_dense(name: str, numel: int, min_numel: int) -> bool:
    """Whether every method sends the tensor ``name`` of ``numel`` values dense (fp32 up, exact
    down): it is small (under ``min_numel``) or a running statistic."""
    return numel < min_numel or is_statistic(name)
