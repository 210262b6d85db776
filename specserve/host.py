"""Host-side lists to tensors: the index arrays a step builds in Python, in one transfer.

`torch.tensor` parses a nested Python list element by element (8 us for a 2 x 2 list on the
development CPU); numpy builds the same int64 array in a fraction of that, and
`torch.from_numpy` shares its memory, so a small index tensor costs about 2 us on the host
plus the one copy to the device.
"""

from __future__ import annotations

import numpy as np
import torch


def int_tensor(values, device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 tensor on `device` of a (nested, rectangular) list of ints."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if getattr(device, "type", device) == "cpu" else t.to(device)  # (a call less on the CPU)
