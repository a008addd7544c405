"""Statistics name the user's K and the copy limit apart: under -k auto a copying drafter (suffix, suffix+MODEL) may
verify a free copy of up to the copy limit (64) in one step, while a model's drafts keep to K (auto's cap, 8)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdecode.cli.app import app
from specdecode.engine.generators import SpeculativeGenerator
from specdecode.policy.speculation import MAX_COPY_K

FAST = ["--draft-quantize", "none"]


def generate(*args) -> CliRunner:
    result = CliRunner().invoke(app, ["generate", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize("draft,k,named,copies", [
    ("suffix+{draft}", "auto", 8, MAX_COPY_K),  # the case that read 64 as K
    ("suffix", "auto", 8, MAX_COPY_K),
    ("{draft}", "auto", 8, 8),  # a model alone copies nothing
    ("suffix+{draft}", "4", 4, 4),  # a fixed K bounds copies too
])
def test_stats_carry_k_and_the_copy_limit_apart(tiny_model_dirs, draft, k, named, copies):
    result = generate("def f(x):", "--target", tiny_model_dirs["target"], "--draft",
                      draft.format(draft=tiny_model_dirs["draft"]), "-k", k, "-n", 6, "--json", *FAST)
    stats = json.loads(result.stdout.splitlines()[-1])["stats"]
    assert stats["num_speculative_tokens"] == named and stats["copy_limit"] == copies


def test_verbose_output_shows_the_copy_limit_beside_k(tiny_model_dirs):
    result = generate("def f(x):", "--target", tiny_model_dirs["target"], "--draft",
                      f"suffix+{tiny_model_dirs['draft']}", "-n", 6, "-v", *FAST)
    assert f"at most 8 from a model, {MAX_COPY_K} copied" in result.output


def test_a_serving_session_names_them_apart_too(tiny_pair):
    """The server reads a session's Stats (its responses' num_speculative_tokens is the user's K)."""
    from specdecode.drafters import SuffixDrafter, SuffixModelDrafter

    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, SuffixModelDrafter(draft, SuffixDrafter()), vocab_size=320)
    session = gen.session()
    assert (session.stats.num_speculative_tokens, session.stats.copy_limit) == (8, MAX_COPY_K)
    plain = SpeculativeGenerator(target, None, vocab_size=320).session()
    assert (plain.stats.num_speculative_tokens, plain.stats.copy_limit) == (0, 0)


def test_a_servers_response_names_k_and_the_copy_limit_apart(tiny_pair, tokenizer):
    import httpx

    from specdecode.drafters import SuffixDrafter
    from specdecode.server import ServerSettings, create_app
    from test_server_helpers import LiveServer

    generator = SpeculativeGenerator(tiny_pair[0], SuffixDrafter(history_tokens=0), "auto", tokenizer=tokenizer)
    with LiveServer(create_app(generator, "tiny", tokenizer, ServerSettings())) as server:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "a b a b a b", "max_tokens": 8, "temperature": 0}).json()
    assert (reply["speculative"]["num_speculative_tokens"], reply["speculative"]["copy_limit"]) == (8, MAX_COPY_K)
