"""Where a benchmark ran: versions, the machine, and the backend, device and dtype of the target."""

from __future__ import annotations

import os
import platform

import torch


def environment(generator=None) -> dict:
    """Versions, machine, and where the generator's target runs (its backend, device, and dtype when known)."""
    import transformers

    from .. import __version__

    env = {"specdecode": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads()}
    if generator is not None:
        device = generator.target.device
        env.update(backend=type(generator.target).__name__, device=str(device))
        parameters = getattr(generator.target_model, "parameters", None)
        param = next(parameters(), None) if callable(parameters) else None
        if param is not None:
            env["dtype"] = str(param.dtype).replace("torch.", "")
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    return env
