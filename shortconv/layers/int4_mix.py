"""Which of int4's body linears take q6 instead of q4: llama.cpp's Q4_K_M rule for ffn_down.

Q4_K_M (llama.cpp's llama_tensor_get_type, `use_more_bits`) keeps ffn_down in Q6_K in the first
eighth of the layers, the last eighth, and every third layer between (i - n/8) % 3 == 2: for
LFM2-350M's 16 layers, 0, 1, 4, 7, 10, 13, 14 and 15. The choice is made once, when the methods
are bound (layers.linear_binding), from the model's own layer names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# A dense SwiGLU's down projection: `layers.{i}.feed_forward.w2` (LFM2, LFM3; MoE experts are
# no linear layer, so they stay in their own format).
_FFN_DOWN = re.compile(r"(?:^|\.)layers\.(\d+)\.feed_forward\.w2$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers), in its integer arithmetic."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def q6_ffn_down(names: Iterable[str]) -> frozenset[str]:
    """The names among `names` (qualified linear names) of the ffn_down layers the rule picks,
    by their layer index among all the model's layers (llama.cpp's i_layer of n_layer)."""
    names = list(names)
    indices = [int(m.group(1)) for n in names if (m := _LAYER.search(n))]
    num_layers = max(indices, default=-1) + 1
    return frozenset(
        n for n in names if (m := _FFN_DOWN.search(n)) and more_bits(int(m.group(1)), num_layers)
    )
