"""The costs the speculation policy starts a CLI, server or Ray run from, before it has timed a step
(policy.estimates.CostPrior): this machine's recorded costs of the target, a CPU's shape for a real model where
nothing is recorded, or the policy's default (a GPU's shape)."""

from __future__ import annotations

from pathlib import Path

STEEP_BYTES = 100 * 2**20  # a target this large streams its weights for longer than a forward's fixed costs take:
                           # on a CPU its forward of n tokens grows with n (CostPrior.cpu); a smaller one's is flat


def on_gpu(opts, target) -> bool:
    """Whether the target runs on a GPU: its model's device (a LoadedModel's model: a transformers model or a
    backend, both with a device), or a device map that spreads it over devices."""
    from ..text.vocab import unwrap_model

    model, _ = unwrap_model(target)
    return getattr(getattr(model, "device", None), "type", "cpu") != "cpu" or opts.device_map is not None


def recorded_cost_prior(opts, target):
    """What the speculation policy takes a step to cost before it times one (policy.estimates.CostPrior): on a CPU,
    the costs of this target recorded on this machine (by `--draft auto` or `advise`; the draft step's only where
    they were this draft model's and timed), else, for a target of at least STEEP_BYTES of weights, a CPU's shape
    (CostPrior.cpu); None on a GPU or for a smaller target (the policy's default, a GPU's shape: flat). On 2 cores
    that default takes verifying 2 tokens for 1.15 steps where it costs 1.4-1.7, so a run's first steps draft where
    nothing can pay, the draft first reading the whole prompt (a chat prompt's code edit: 0.95x plain over 128
    tokens, docs/BENCHMARKS.md)."""
    from ..policy.estimates import CostPrior
    from .draft_choice import recorded_target_costs

    if not opts.has_draft or on_gpu(opts, target):
        return None
    found = recorded_target_costs(opts.target, opts.draft_model, opts.backend, opts.threads)
    if found is None:
        return CostPrior.cpu() if (weights_bytes(target) or 0) >= STEEP_BYTES else None
    costs, same_draft = found
    timed = same_draft and not costs.draft_step_floor and costs.draft_step > 0
    return CostPrior.measured({**costs.verify, **costs.copies}, costs.draft_step if timed else None)


def weights_bytes(target) -> int | None:
    """The size of a loaded model's weights on disk (its GGUF file, or its directory's safetensors files); None
    where it was not loaded from a path (a model object the caller built)."""
    from ..models.sources import LoadedModel

    if not isinstance(target, LoadedModel) or not target.path:
        return None
    path = Path(target.path)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.gguf"))
    return sum(f.stat().st_size for f in files) or None
