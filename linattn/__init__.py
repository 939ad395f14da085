"""Head-sharded linear-attention layers (gated delta net, Kimi delta attention) with tensor,
sequence and context parallelism, kernel selection over fla's backends, and float64 references.

Importing this package is cheap: nothing here imports fla; GPU paths import it lazily.
"""

__version__ = "0.1.0"
