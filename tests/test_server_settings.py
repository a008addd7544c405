"""ServerSettings is the one place a server's limits are checked (the CLI, Ray Serve configs and create_app all go
through it): every limit refused with an OptionError naming its field, and the spellings it normalises."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode.errors import OptionError
from specdecode.server import ServerSettings
from specdecode.policy.speculation import MAX_K


@pytest.mark.parametrize("field,value,message", [
    ("max_batch_size", 0, "max_batch_size must be an integer >= 1, got 0"),
    ("max_queue", 2.5, "max_queue must be an integer >= 1, got 2.5"),
    ("max_tokens_limit", True, "max_tokens_limit must be an integer >= 0, got True"),
    ("max_prompt_chars", 0, "max_prompt_chars must be an integer >= 1"),
    ("default_predict_tokens", -1, "default_predict_tokens must be an integer >= 1"),
    ("max_speculative_tokens", MAX_K + 1, f"max_speculative_tokens must be an integer between 1 and {MAX_K}"),
    ("retry_after_s", -1, "retry_after_s must be an integer >= 0"),
    ("prefill_tokens_per_step", -1, "prefill_tokens_per_step must be an integer >= 0"),
    ("request_timeout", -1, "request_timeout must be a number of seconds >= 0 (0: no limit), got -1"),
    ("request_timeout", float("inf"), "request_timeout must be a number of seconds >= 0 (0: no limit)"),
    ("queue_timeout", "60", "queue_timeout must be a number of seconds >= 0 (0: no limit), got '60'"),
    ("stall_timeout", float("nan"), "stall_timeout must be a number of seconds >= 0 (0: no limit)"),
    ("shutdown_grace_s", -1.0, "shutdown_grace_s must be a number of seconds >= 0"),
    ("served_model_names", ("ok", " "), "served model names must be non-empty strings"),
])
def test_each_limit_is_refused_naming_its_field(field, value, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")) as excinfo:
        ServerSettings(**{field: value})
    assert excinfo.value.option == field


def test_normalised_spellings():
    settings = ServerSettings(prefill_tokens_per_step=0, api_key="", served_model_names="coder")
    assert settings.prefill_tokens_per_step is None  # 0: whole prompts at once, as the batcher takes it
    assert settings.api_key is None and settings.served_model_names == ("coder",)
    assert ServerSettings(shutdown_grace_s=0).shutdown_grace_s == 0
    assert ServerSettings(request_timeout=None).request_timeout == 0  # a config file's null: no deadline, as 0
    assert ServerSettings().max_speculative_tokens == MAX_K  # the bound of Speculation.parse, not a second rule


def test_settings_travel_as_plain_data_and_come_back_equal():
    """Ray Serve replicas rebuild their settings from dataclasses.asdict (see server/ray_serve.replica_config)."""
    settings = ServerSettings(max_batch_size=4, served_model_names=("a", "b"), prefill_tokens_per_step=0)
    assert ServerSettings(**dataclasses.asdict(settings)) == settings
