"""The exact math of speculative decoding: sampling warps and per-row random streams, penalties, the
rejection rule (min(1, p/q), the residual, the bonus token), token trees, and the per-row verification of a step.
Nothing here knows about models, drafters or requests."""
