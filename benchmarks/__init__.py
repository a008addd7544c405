"""The project's own measuring tools, run from a checkout of the repository, never installed with the package
(what a user runs, `specdecode bench`, `bench serve`, `advise`, `soak`, `bench latency`, lives in specdecode.bench):

  device_check     the borrowed-GPU check (scripts/device_check.sh runs it): the driver; its sections in
                   device_sections, device_overhead (the engine at known acceptance) and device_compiled (the
                   step against its floor), its markdown in device_report, the wheels it carries in device_wheels,
                   its journal of rows and progress (written as it goes, read back when a section is killed) in
                   device_journal; the cross_vocab section (a draft of another tokenizer) in device_cross_vocab,
                   the real tokenizers it carries in device_tokenizers;
  random_models    random-weight models of real Qwen2.5 and SmolLM2-135M shapes (transformers and GGUF) for timing;
  text_oracle      a backend of no cost that writes a known text in a tokenizer's tokens (a drafter's own cost);
  replay_drafter   a drafter of known acceptance (the engine against Leviathan's prediction);
  forward_drift    how far llama.cpp's verification numbers move from token-by-token decoding;
  step_host_time   the host time of a speculative step on the static backend, batch 1 against 4, by phase.

Run from the repository's root: `python -m benchmarks.device_check ...`; tests import it the same way (the root on
sys.path). It imports specdecode (installed, or src/ on PYTHONPATH); the package never imports it."""
