"""transformers 5.x renamed the forward's `past_key_values` to `cache` and will remove the old name (5.40 for
forward, 6.0 for generate). The backends pass the cache under whichever name the installed model takes, so they
neither warn today nor break when the old name goes, and still work on the 5.x releases that know only the old one."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdecode.backends.hf import HFBackend, cache_keyword
from specdecode.backends.static import StaticBackend


def _tiny() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(config).eval()


def test_the_keyword_follows_the_signature():
    def renamed(input_ids=None, cache=None, **kwargs): ...

    def older(input_ids=None, past_key_values=None, **kwargs): ...

    def opaque(*args, **kwargs): ...

    assert cache_keyword(renamed) == "cache"
    assert cache_keyword(older) == "past_key_values"
    # a wrapper that hides the signature gets the name the installed transformers gives its own models
    library = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    assert cache_keyword(opaque) == library


def _steps(backend) -> torch.Tensor:
    """A prefill and two single-token steps, as the decoding loop runs them; the logits of the last step."""
    backend.reset(1)
    backend.forward(torch.tensor([[1, 5, 9, 3]]))
    backend.forward(torch.tensor([[7]]))
    return backend.forward(torch.tensor([[11]]), last_only=True)


def test_backends_pass_the_cache_without_a_deprecation_warning_and_use_it():
    model = _tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dynamic = _steps(HFBackend(model))
        static = _steps(StaticBackend(model, max_batch=1, max_len=32, cuda_graphs=False))
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    # The cache was really used: the steps' logits are those of one forward over the whole sequence.
    with torch.inference_mode():
        full = model(torch.tensor([[1, 5, 9, 3, 7, 11]])).logits[:, -1:].float()
    torch.testing.assert_close(dynamic, full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(static, full, atol=1e-5, rtol=1e-4)


def test_generate_takes_the_cache_under_the_forwards_keyword():
    """The bench's transformers peer hands generate() its own cache: same keyword, no warning, same tokens."""
    model = _tiny()
    prompt = torch.tensor([[1, 5, 9, 3]])
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        given = model.generate(prompt, **settings, **{cache_keyword(model.forward): DynamicCache(config=model.config)})
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(given, model.generate(prompt, **settings))
