"""Benchmarks: our loop against transformers (runner), the statistics they rest on (stats), the built-in prompt
sets (prompts) and the figure (plot). Import the submodules directly; this package imports nothing heavy."""
