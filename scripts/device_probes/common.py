"""What every device probe starts from: the device check's plan (--dry: tiny shapes on the CPU), the output folder
($OUT on the lent machine), and the target and draft built to copy their current token (random weights, real
shapes)."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ lives in the checkout, not the package
from benchmarks.device_sections import Plan  # noqa: E402
from benchmarks.random_models import SHAPES, build_qwen  # noqa: E402


def setup():
    """(plan, out folder, device, target, draft, vocabulary size)."""
    plan = Plan.dry() if "--dry" in sys.argv else Plan.full()
    out = os.environ.get("OUT", "/tmp/device-probe")
    os.makedirs(out, exist_ok=True)
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    target = build_qwen(plan.target, device, dtype, seed=0, copying=True)
    draft = build_qwen(plan.draft, device, dtype, seed=1, copying=True)
    return plan, out, device, target, draft, SHAPES[plan.target][5]
