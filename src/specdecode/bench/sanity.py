"""`specdecode bench --sanity`: the draft is the target and decoding is greedy, so every draft must be accepted;
the gap between the measured and the expected speedup (with the measured c ≈ 1 and v) is the loop's own cost."""

from __future__ import annotations

from .methods.specdecode import SpecDecode
from .methods.specdecode_plain import SpecDecodePlain

METHODS = (SpecDecodePlain.name, SpecDecode.name)  # what a sanity run times


def sanity_verdict(report: dict) -> dict:
    """Pass when every fixed-K configuration of ours accepted every draft; the overhead of each next to it."""
    checks = []
    costs = report["costs"]
    for config in report["sweep"]:
        spec = config["methods"].get(SpecDecode.name)
        if spec is None:
            continue
        theory = config.get("theory") or {}
        expected = theory.get("expected_speedup_refined")
        measured = theory.get("measured_speedup")
        checks.append({"k": config["k"], "acceptance_rate": spec["acceptance_rate"],
                       "rejected": spec["stats"]["proposed_tokens"] - spec["stats"]["accepted_tokens"],
                       "pass": spec["acceptance_rate"] == 1.0,
                       "measured_speedup": measured, "expected_speedup": expected,
                       "overhead": (1.0 - measured / expected) if measured and expected else None})
    return {"pass": bool(checks) and all(c["pass"] for c in checks), "c": costs.get("c"), "checks": checks,
            "note": "draft = target and greedy: every draft must be accepted. The expected speedup uses the "
                    "measured c (≈ 1) and v; overhead = 1 − measured / expected is the loop's own cost."}
